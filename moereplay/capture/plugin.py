"""The vLLM general plugin: ``register()`` behind the ``vllm.general_plugins`` entry point ``moereplay``.

vLLM calls ``register()`` once in every process it starts (API server, engine core, workers;
``vllm.plugins.load_general_plugins``, honouring the ``VLLM_PLUGINS`` allow-list). Importing this module does
nothing (no torch, no vLLM). With ``MOEREPLAY_CAPTURE`` unset or off, ``register()`` returns without importing
or patching anything. Otherwise it arms the capture (:func:`moereplay.capture.session.arm`); a malformed
setting or any failure is logged on one line and leaves vLLM untouched — ``register()`` never raises.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("moereplay.capture")


def register() -> None:
    """Entry point: arm the capture in this process if ``MOEREPLAY_CAPTURE`` asks for it."""
    value = os.environ.get("MOEREPLAY_CAPTURE", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return
    try:
        from moereplay.capture.session import arm

        arm()
    except Exception as error:
        from moereplay.errors import SettingsError

        if isinstance(error, SettingsError):
            logger.error("moereplay: capture stays off: %s", error)
        else:
            logger.error("moereplay: capture stays off: %s: %s", type(error).__name__, error)
