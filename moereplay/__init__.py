"""moereplay: capture, replay and bisect the MoE kernel calls of vLLM.

The package is layered; the folders are the architecture:

- ``format/``    capture file format v1 (msgpack documents in zstd frames): writer, reader, tensor codec.
- ``capture/``   the vLLM general plugin and the recorder that writes calls while serving.
- ``reference/`` exact fp32 references for the kernels (quant formats, Marlin layout, Hopper swizzles).
- ``ops/``       one module per kernel family: argument schema, mutation domains, contracts, reference glue.
- ``replay/``    rerun a captured call with mutations on a backend, compare, findings.
- ``pack/``      kernel packs: vLLM's compiled MoE kernels extracted from an official wheel.
- ``cli/``       the thin typer front end; ``tui/`` the Textual app.

Only ``cli/`` and ``tui/`` may import typer, rich or textual.
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``moereplay.replay(...)``: the replay subpackage, imported on first use; it is callable (see there)."""
    if name == "replay":
        import importlib

        return importlib.import_module("moereplay.replay")
    raise AttributeError(f"module 'moereplay' has no attribute {name!r}")
