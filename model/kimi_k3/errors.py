"""The command line's vocabulary, shared by the model area (model/kimi_k3/cli.py, the benches) and the gating
area (gates/commands): what a usage error is, and the exit codes."""

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with what the user asked for; printed without a traceback, exit code 2."""
