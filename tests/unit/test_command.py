"""The zerofit command's entry point on an install without the command line's extra."""

import subprocess
import sys

PROBE = """
import sys
sys.modules["typer"] = None     # as if the `cli` extra were not installed
from zerofit.command import main
main()
"""


def test_the_command_without_its_extra_says_what_to_install():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "pip install 'zerofit[cli]'" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_command_with_its_extra_runs_the_cli():
    r = subprocess.run(
        [sys.executable, "-c", "from zerofit.command import main; main()", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "estimate" in r.stdout and "train" in r.stdout


def test_the_library_imports_without_the_extras():
    probe = (
        "import sys\n"
        "for name in ('typer', 'rich', 'datasets', 'tensorboard', 'ninja'):\n"
        "    sys.modules[name] = None\n"
        "import zerofit, zerofit.deepspeed, zerofit.fsdp, zerofit.hf, zerofit.lora\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
