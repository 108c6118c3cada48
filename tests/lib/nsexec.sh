#!/bin/bash
# Open MPI's rsh agent for network-namespace "hosts" on one machine: `nsexec.sh [options] HOST
# COMMAND...` ("ssh" to HOST) enters namespace HOST with its own hostname and runs COMMAND.
# The options Open MPI passes (-x, -o ...) mean nothing here and are skipped.
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
host="$1"; shift
exec ip netns exec "$host" unshare --uts /bin/bash -c "hostname $host; $*"
