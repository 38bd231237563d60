"""The README's two commands: CI runs the test command word for word."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def commands():
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```sh\n")[1:]
    return [b.split("```")[0].strip() for b in blocks]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = [c for c in commands() if "pytest" in c]
    assert len(test_cmd) == 1
    assert test_cmd[0] in ci.splitlines()


def test_readme_main_job_runs_the_bundled_default():
    main = [c for c in commands() if "moelab simulate" in c]
    assert main and "pip install" in main[0]
