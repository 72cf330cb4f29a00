"""Built-in codecs register on first need, so a fresh process (CLI, replay worker, TUI) loads recipe tensors."""

from __future__ import annotations

import subprocess
import sys

from moereplay.format.codecs import BUILTIN_CODEC_PROVIDERS


def test_recipe_codec_is_found_in_a_fresh_process_and_unknown_names_import_nothing() -> None:
    script = (
        "import sys\n"
        "from moereplay.format.codecs import codec_for, _codecs\n"
        "name = 'moereplay.synth.recipe.TensorRecipe'\n"
        "assert name not in _codecs\n"
        "assert codec_for(name) is not None and codec_for(name).type_name == name\n"
        "before = set(sys.modules)\n"
        "assert codec_for('json.JSONDecoder') is None\n"
        "assert codec_for('os.system') is None\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_builtin_providers_are_moereplay_modules_only() -> None:
    assert BUILTIN_CODEC_PROVIDERS
    assert all(module.startswith("moereplay.") for module in BUILTIN_CODEC_PROVIDERS.values())
