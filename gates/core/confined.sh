#!/bin/sh
# The interpreter a sandbox's child is spawned with (gates.core.sandbox sets it as multiprocessing's executable
# while it starts one): Python itself, under the isolation launcher, which confines the process and then becomes
# the command line multiprocessing asked for.
exec "$K3FORGE_PYTHON" "${0%/*}/isolation.py" "$K3FORGE_PYTHON" "$@"
