"""Helpers several test files import."""
import subprocess
import sys


def exit_before_tensorflow(argv: list[str]) -> subprocess.CompletedProcess:
    """Runs the script argv[0] with argv in a fresh Python; its stdout is then "CODE LOADED":
    the exit code and whether TensorFlow was imported (stderr is the script's)."""
    return subprocess.run([sys.executable, "-c", (
        "import runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as exit:\n    code = exit.code\n"
        "print(code, 'tensorflow' in sys.modules)")], capture_output=True, text=True, timeout=60)
