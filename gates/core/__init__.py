"""The judging core: the gate registry and runner, the sandbox and its worker, statuses, the machine, covered
sources and the harness digest, contract checks, tensor comparison and timing estimates.

Not here: the gates themselves (gates.checks), what a bundle holds and how it is read back (gates.evidence), and
the command line (gates.commands).
"""
