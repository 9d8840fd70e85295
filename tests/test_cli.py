import subprocess
import sys

from inflight.cli import COMMANDS, main


def test_help_lists_every_command_with_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, desc) in COMMANDS.items():
        assert f"{name}" in out and desc in out


def test_unknown_command_is_an_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "inflight.cli", "--help"], capture_output=True, text=True, check=True)
    assert "make-model" in out.stdout
