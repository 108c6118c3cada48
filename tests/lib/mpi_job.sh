# Shared by the test scripts that start an mpirun job and must find and clean up its processes.
# Source it after setting TAG (a value unique to the run, passed to the ranks as
# MOERUN_TEST_TAG), WORK (a scratch folder) and MPI_PID (mpirun's pid once started, else "").

# Every process of this run: the ones carrying our tag in their environment.
tagged_pids() {
  local p
  for p in /proc/[0-9]*; do
    grep -qzx "MOERUN_TEST_TAG=$TAG" "$p/environ" 2>/dev/null && echo "${p#/proc/}"
  done
}

# The pid(s) of rank $1's moerun process (not mpirun's): one per line, none if it is gone.
rank_pid() {
  local p
  for p in $(tagged_pids); do
    if grep -qzx "OMPI_COMM_WORLD_RANK=$1" "/proc/$p/environ" 2>/dev/null &&
       grep -qz moerun "/proc/$p/cmdline" 2>/dev/null && ! grep -qz mpirun "/proc/$p/cmdline"; then
      echo "$p"
    fi
  done
}

# Kills every process of the run (resuming stopped ones first), then removes WORK (kept with
# KEEP_WORK=1).
cleanup_job() {
  local p
  for p in $(tagged_pids); do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  if [[ -n "$MPI_PID" ]]; then kill -KILL "$MPI_PID" 2>/dev/null; wait "$MPI_PID" 2>/dev/null; fi
  if [[ -n ${KEEP_WORK:-} ]]; then echo "work folder kept: $WORK" >&2; else rm -rf "$WORK"; fi
}

# Waits up to $2 seconds (default 30) for process $1, a child of this shell, to exit: returns its
# exit status, or 124 while it still runs.
wait_exit_within() {
  local pid=$1 tenths=$((${2:-30} * 10))
  for _ in $(seq "$tenths"); do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid"
      return $?
    fi
    sleep 0.1
  done
  return 124
}

# Waits up to $3 seconds for a line matching the extended regex $2 in file $1 (1 if none came).
wait_line() {
  local t=$SECONDS
  until grep -Eq "$2" "$1" 2>/dev/null; do
    (( SECONDS - t > $3 )) && return 1
    sleep 0.1
  done
}
