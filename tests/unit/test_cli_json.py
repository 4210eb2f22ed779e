"""``--json`` prints only the report on stdout: what else is written there meanwhile, by this
process or one it starts (Ray's log lines), goes to stderr."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys
    import specray.cli as cli

    def noisy(args):
        os.write(1, b"a line written to descriptor 1\\n")
        print("progress")
        subprocess.run([sys.executable, "-c", "print('a child process line')"], check=True)
        cli._print_json(json.dumps({"ok": 1}))
        return 0

    cli._main = noisy
    sys.exit(cli.main(sys.argv[1:]))
    """
)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True, timeout=120
    )


def test_json_report_alone_on_stdout():
    result = _run("bench", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"ok": 1}
    for line in ("a line written to descriptor 1", "progress", "a child process line"):
        assert line in result.stderr
    # Negative control: without --json the same lines reach stdout.
    plain = _run("bench", "--verify")
    assert "a child process line" in plain.stdout and "progress" in plain.stdout
