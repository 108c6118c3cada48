#!/usr/bin/env bash
# The Slurm batch scripts of deploy/slurm/ under a real Slurm: starts its own munged (own socket
# and key), slurmctld and slurmd in a temp folder on free ports, submits
# deploy/slurm/moerun-serve.sbatch (4 tasks, MOERUN_CHECK=1: moebench serve --verify against the
# job, then a drain) and deploy/slurm/moebench.sbatch with `sbatch --wait`, checks every answer
# verified and none wrong, the serve job's ready file, moectl status and exit 0, that the bench
# JSON parses, prints the job logs, then stops Slurm and munge and removes everything (trap).
#
#   slurm.sh MOERUN_BIN MOECTL_BIN MOEBENCH_BIN SOURCE_DIR [--two-nodes]
#
# --two-nodes (scripts/full.sh; root): two "nodes" h1, h2 in network namespaces joined by a
# veth pair, one slurmd each (slurmctld in h1), and the serve job with -N 2 (2 tasks a node).
# Fails (exit 1) with a clear message when slurm-wlm or munge is missing
# (scripts/install-deps.sh --test installs them). KEEP_WORK=1 keeps the temp folder.
set -euo pipefail

usage() { echo "usage: slurm.sh MOERUN MOECTL MOEBENCH SOURCE_DIR [--two-nodes]" >&2; exit 2; }
[[ $# -ge 4 ]] || usage
MOERUN=$(realpath -e "$1"); MOECTL=$(realpath -e "$2"); MOEBENCH=$(realpath -e "$3")
SRC=$(realpath -e "$4")
TWO=0
if [[ $# -ge 5 ]]; then [[ $5 == --two-nodes ]] || usage; TWO=1; fi

fail() { echo "FAIL: $*"; exit 1; }
for t in slurmctld slurmd sbatch squeue sacct scontrol sinfo srun munged mungekey; do
  p=$(command -v "$t" || echo "/usr/sbin/$t")
  [[ -f $p && -x $p ]] ||
    fail "$t is not installed: Slurm tests need slurm-wlm and munge (scripts/install-deps.sh --test)"
done
export PATH=$PATH:/usr/sbin
[[ $(id -u) == 0 ]] || fail "needs root (slurmd runs jobs as their user; namespaces)"
unset SLURM_JOB_ID SLURM_JOBID SLURM_NTASKS SLURM_CONF OMPI_COMM_WORLD_RANK PMIX_RANK 2>/dev/null || true

WORK=$(mktemp -d /tmp/moerun-slurm.XXXXXX)
chmod 755 "$WORK"
SUFFIX=$(printf '%04x%02x' $((RANDOM)) $(($$ % 256)))
H1="msl1-$SUFFIX"; H2="msl2-$SUFFIX"; V1="msv1-$SUFFIX"; V2="msv2-$SUFFIX"
NET=$((RANDOM % 250 + 1)); IP1="10.232.$NET.1"; IP2="10.232.$NET.2"
MADE_NS=()
PIDS=()

cleanup() {
  local rc=$? p ns
  set +e
  if [[ -f $WORK/slurm.conf ]]; then
    SLURM_CONF=$WORK/slurm.conf in_ctl scancel --full --quiet -u root 2>/dev/null
    sleep 0.5
  fi
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  sleep 0.5
  for ns in "${MADE_NS[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  done
  # slurmstepd and job processes are children of slurmd's session; find them by our folder.
  for p in /proc/[0-9]*; do
    [[ ${p#/proc/} == "$$" ]] && continue
    if grep -qz "$WORK" "$p/cmdline" 2>/dev/null || grep -qz "SLURM_CONF=$WORK" "$p/environ" 2>/dev/null; then
      kill -KILL "${p#/proc/}" 2>/dev/null
    fi
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  [[ -f $WORK/munged.pid ]] && kill -TERM "$(cat "$WORK/munged.pid")" 2>/dev/null
  sleep 0.2
  for ns in "${MADE_NS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  ip link del "$V1" 2>/dev/null
  if [[ -n ${KEEP_WORK:-} ]]; then echo "work folder kept: $WORK" >&2; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP

# Runs a command where slurmctld is reachable (namespace h1 in --two-nodes mode).
in_ns() {  # NS HOST CMD...
  local ns=$1 host=$2; shift 2
  ip netns exec "$ns" unshare --uts /bin/bash -c 'hostname "$0"; exec "$@"' "$host" "$@"
}
in_ctl() { if [[ $TWO == 1 ]]; then in_ns "$H1" h1 "$@"; else "$@"; fi; }

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
pick_block() {  # N -> first of N consecutive free ports
  local b i ok
  for _ in $(seq 50); do
    b=$((20000 + RANDOM % 12000)); ok=1
    for ((i = 0; i < $1; i++)); do port_free $((b + i)) || { ok=0; break; }; done
    [[ $ok == 1 ]] && { echo "$b"; return; }
  done
  fail "no $1 free ports"
}
PORTS=$(pick_block 24)
CTLD_PORT=$PORTS; SLURMD_PORT=$((PORTS + 1)); SERVE_BASE=$((PORTS + 4))

# munge: our own daemon, socket and key.
mkdir -p "$WORK/munge"; chmod 700 "$WORK/munge"
mungekey -c -k "$WORK/munge/munge.key" -b 1024 >/dev/null 2>&1 ||
  { dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 2>/dev/null; chmod 400 "$WORK/munge/munge.key"; }
MUNGE_SOCK=$WORK/munge/munge.socket
munged --force --socket="$MUNGE_SOCK" --key-file="$WORK/munge/munge.key" \
  --pid-file="$WORK/munged.pid" --log-file="$WORK/munge/munged.log" \
  --seed-file="$WORK/munge/munged.seed" 2>"$WORK/munge/start.err" ||
  fail "munged did not start: $(cat "$WORK/munge/start.err" "$WORK/munge/munged.log" 2>/dev/null)"
for _ in $(seq 50); do [[ -S $MUNGE_SOCK ]] && break; sleep 0.1; done
[[ -S $MUNGE_SOCK ]] || fail "munged made no socket"

# Nodes: this host at 127.0.0.1, or h1/h2 in namespaces.
if [[ $TWO == 1 ]]; then
  ip netns add "$H1" 2>"$WORK/ns.err" || fail "cannot add network namespaces: $(cat "$WORK/ns.err")"
  MADE_NS+=("$H1")
  ip netns add "$H2"; MADE_NS+=("$H2")
  ip link add "$V1" type veth peer name "$V2"
  ip link set "$V1" netns "$H1"; ip link set "$V2" netns "$H2"
  ip -n "$H1" addr add "$IP1/24" dev "$V1"; ip -n "$H2" addr add "$IP2/24" dev "$V2"
  for ns in "$H1" "$H2"; do ip -n "$ns" link set lo up; done
  ip -n "$H1" link set "$V1" up; ip -n "$H2" link set "$V2" up
  CTL_HOST=h1; CTL_ADDR=$IP1
  NODES="NodeName=h1 NodeAddr=$IP1 NodeHostname=h1 CPUs=4
NodeName=h2 NodeAddr=$IP2 NodeHostname=h2 CPUs=4"
  NODELIST=h1,h2
else
  CTL_HOST=$(hostname); CTL_ADDR=127.0.0.1
  NODES="NodeName=$CTL_HOST NodeAddr=127.0.0.1 CPUs=8"
  NODELIST=$CTL_HOST
fi
mkdir -p "$WORK/state" "$WORK/spool" "$WORK/log" "$WORK/jobs"
cat >"$WORK/slurm.conf" <<CONF
ClusterName=moerun-test
SlurmctldHost=$CTL_HOST($CTL_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SlurmdParameters=config_overrides
MpiDefault=none
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool/%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd-%n.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd-%n.log
TmpFS=$WORK/tmp-%n
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SchedulerType=sched/backfill
MinJobAge=300
KillWait=5
$NODES
PartitionName=test Nodes=$NODELIST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
echo "CgroupPlugin=cgroup/v1" >"$WORK/cgroup.conf"
export SLURM_CONF=$WORK/slurm.conf

slurm_logs() {
  local f
  for f in "$WORK"/log/*; do [[ -s $f ]] && { echo "--- $f (tail)"; tail -20 "$f"; }; done
}
die_slurm() { echo "FAIL: $*"; slurm_logs; exit 1; }

if [[ $TWO == 1 ]]; then
  mkdir -p "$WORK/tmp-h1" "$WORK/tmp-h2" "$WORK/spool/h1" "$WORK/spool/h2"
  in_ns "$H1" h1 slurmctld -D -i >"$WORK/log/slurmctld.out" 2>&1 & PIDS+=($!)
  in_ns "$H1" h1 slurmd -D -N h1 >"$WORK/log/slurmd-h1.out" 2>&1 & PIDS+=($!)
  in_ns "$H2" h2 slurmd -D -N h2 >"$WORK/log/slurmd-h2.out" 2>&1 & PIDS+=($!)
else
  mkdir -p "$WORK/tmp-$CTL_HOST" "$WORK/spool/$CTL_HOST"
  slurmctld -D -i >"$WORK/log/slurmctld.out" 2>&1 & PIDS+=($!)
  slurmd -D >"$WORK/log/slurmd.out" 2>&1 & PIDS+=($!)
fi
want=1; [[ $TWO == 1 ]] && want=2
for _ in $(seq 120); do
  n=$(in_ctl sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l) || n=0
  (( n >= want )) && break
  for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || die_slurm "a Slurm daemon exited"; done
  sleep 0.5
done
(( n >= want )) || die_slurm "$want idle node(s) not up within 60 s: $(in_ctl sinfo 2>&1)"
echo "Slurm up: $(in_ctl sinfo -h -N -o '%N %T %c' | paste -sd';')"

# submit_wait NAME COMMAND...: runs the `sbatch --wait --parsable ... --output=$WORK/jobs/NAME-%j.out`
# COMMAND on the control node, prints the job's output; sets JOB (its id) and RC (sbatch's exit).
submit_wait() {
  local name=$1
  shift
  set +e
  in_ctl "$@" >"$WORK/jobs/$name.id" 2>"$WORK/jobs/$name.err"
  RC=$?
  set -e
  JOB=$(head -1 "$WORK/jobs/$name.id" | cut -d';' -f1)
  [[ -n $JOB ]] || die_slurm "sbatch did not submit the $name job: $(cat "$WORK/jobs/$name.err")"
  dump_job "$JOB" "$WORK/jobs/$name-$JOB.out"
}
dump_job() {  # JOBID OUTFILE
  echo "===== sbatch output of job $1 ($2) ====="
  cat "$2" 2>/dev/null || echo "(no output file)"
  echo "===== end of job $1 ====="
}

# 1. The serve job: MOERUN_CHECK=1 verifies the answers and drains.
cd "$WORK/jobs"
if [[ $TWO == 1 ]]; then NODEARGS=(-N 2 --ntasks-per-node=2); else NODEARGS=(-n 4); fi
t0=$SECONDS
submit_wait serve env CONFIG="$SRC/configs/tiny.yaml" MOERUN_BIN="$MOERUN" MOECTL_BIN="$MOECTL" \
  MOEBENCH_BIN="$MOEBENCH" MOERUN_CHECK=1 MOERUN_CHECK_SECONDS=6 MOERUN_PORT_BASE="$SERVE_BASE" \
  MOERUN_RUN_DIR="$WORK/jobs/serve" MOERUN_READY_TIMEOUT=120 \
  sbatch --wait --parsable --time=5 "${NODEARGS[@]}" --output="$WORK/jobs/serve-%j.out" \
  "$SRC/deploy/slurm/moerun-serve.sbatch"
SJOB=$JOB
src=$RC
echo "serve job $SJOB: sbatch --wait exit $src after $((SECONDS - t0)) s"
[[ $src == 0 ]] || die_slurm "the serve job failed (sbatch --wait exit $src): $(cat "$WORK/jobs/serve.err")"
state=$(in_ctl scontrol show job "$SJOB" -o | grep -o 'JobState=[A-Z]*' || true)
code=$(in_ctl scontrol show job "$SJOB" -o | grep -o 'ExitCode=[0-9:]*' || true)
echo "serve job $SJOB: $state $code"
[[ $state == JobState=COMPLETED && $code == ExitCode=0:0 ]] || fail "serve job ended $state $code"
R=$WORK/jobs/serve
[[ -f $R/ready ]] || fail "the serve job wrote no ready file"
grep -q "^routers=.*:$SERVE_BASE$" "$R/ready" || fail "ready file lacks the router address: $(cat "$R/ready")"
grep -q "^control=.*:$((SERVE_BASE + 8))$" "$R/ready" || fail "ready file lacks the control port"
OUTF=$WORK/jobs/serve-$SJOB.out
for r in 0 1 2 3; do
  grep -Eq "^$r +(router|expert) " "$OUTF" || fail "moectl status in the job log does not show rank $r"
done
/usr/bin/python3 - "$R/check.json" <<'P' || fail "the verified answers do not check out"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"check.json: {r['requests']} requests, {r['ok']} ok, verified {r['verified']}, errors {r['errors']}")
assert r["verify"] is True, "not a verified run"
assert r["requests"] > 0 and r["ok"] == r["requests"], "some requests failed"
assert r["verified"] == r["ok"], "not every answer verified"
assert not r["errors"] and r["error_count"] == 0, "errors (wrong answers?)"
assert r["warmup"]["errors"] == 0
P
grep -q "shut down cleanly" "$OUTF" || fail "the serve job did not drain (no clean shutdown line)"
if [[ $TWO == 1 ]]; then
  grep -Eq "^[0-9]+ +expert +h2 " "$OUTF" || fail "moectl status shows no expert rank on node h2"
fi
echo "PASS serve job: ready file, moectl status, every answer verified, drained, exit 0"

# 2. The default mode, with 2 routers (--two-nodes: 3, so that router 2 is on h2): serves until
# cancelled. moectl and a verified client from here with the ready file's addresses and token,
# then `scancel --batch --signal=TERM` drains it (exit 0).
R2=$WORK/jobs/serve2
MODEL=$SRC/tests/data/hf-moe/deepseek_v3
NR=2; [[ $TWO == 1 ]] && NR=3
sed -e "s|^model:.*|model: $MODEL|" -e "s/^routers:.*/routers: $NR/" "$SRC/configs/tiny.yaml" \
  >"$WORK/jobs/routers.yaml"
grep -q "^routers: $NR$" "$WORK/jobs/routers.yaml" || fail "could not write a $NR-router config"
in_ctl env CONFIG="$WORK/jobs/routers.yaml" MOERUN_BIN="$MOERUN" MOECTL_BIN="$MOECTL" \
  MOERUN_PORT_BASE="$SERVE_BASE" MOERUN_RUN_DIR="$R2" MOERUN_READY_TIMEOUT=120 \
  sbatch --parsable --time=5 "${NODEARGS[@]}" --output="$WORK/jobs/serve2-%j.out" \
  "$SRC/deploy/slurm/moerun-serve.sbatch" >"$WORK/jobs/serve2.id" 2>"$WORK/jobs/serve2.err" ||
  die_slurm "sbatch did not submit the second serve job: $(cat "$WORK/jobs/serve2.err")"
S2=$(cut -d';' -f1 "$WORK/jobs/serve2.id")
OUT2=$WORK/jobs/serve2-$S2.out
for _ in $(seq 240); do
  [[ -f $R2/ready ]] && break
  in_ctl squeue -h -j "$S2" 2>/dev/null | grep -q . || { dump_job "$S2" "$OUT2"; fail "job $S2 ended before it was ready"; }
  sleep 0.5
done
[[ -f $R2/ready ]] || { dump_job "$S2" "$OUT2"; fail "job $S2 not ready within 120 s"; }
ctl=$(sed -n 's/^control=//p' "$R2/ready")
in_ctl "$MOECTL" --target "$ctl" --token-file "$(sed -n 's/^token_file=//p' "$R2/ready")" status \
  >"$WORK/jobs/status2" 2>&1 || { dump_job "$S2" "$OUT2"; fail "moectl status against $ctl failed: $(cat "$WORK/jobs/status2")"; }
grep -q "4 ranks ($NR routers), placement v1, ready" "$WORK/jobs/status2" ||
  fail "moectl status from the ready file: $(cat "$WORK/jobs/status2")"
targets=$(sed -n 's/^routers=//p' "$R2/ready")
want_t=$CTL_ADDR:$SERVE_BASE,$CTL_ADDR:$((SERVE_BASE + 1))
[[ $TWO == 1 ]] && want_t+=",$IP2:$((SERVE_BASE + 2))"
[[ $TWO == 1 || $targets == *:$SERVE_BASE,*:$((SERVE_BASE + 1)) ]] &&
  [[ $TWO == 0 || $targets == "$want_t" ]] || fail "ready file routers=$targets, expected every router ($want_t)"
in_ctl "$MOEBENCH" serve --target "$targets" --concurrency "$NR" --duration 2 --tokens-per-request 8 \
  --warmup 0.3 --verify --model "$MODEL" --json >"$WORK/jobs/client2.json" 2>"$WORK/jobs/client2.err" ||
  { dump_job "$S2" "$OUT2"; fail "moebench serve --verify against $targets: $(cat "$WORK/jobs/client2.err")"; }
grep "verified" "$WORK/jobs/client2.err"
/usr/bin/python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); assert r["ok"]>0 and r["verified"]==r["ok"]==r["requests"] and not r["errors"], r["errors"]' \
  "$WORK/jobs/client2.json" || fail "client answers from the ready file's routers did not all verify"
sleep 1
in_ctl squeue -h -j "$S2" -o %T | grep -q RUNNING || fail "job $S2 is not running after ready"
in_ctl scancel --batch --signal=TERM "$S2"
for _ in $(seq 120); do
  st=$(in_ctl scontrol show job "$S2" -o 2>/dev/null | grep -o 'JobState=[A-Z]*' || true)
  [[ $st == JobState=RUNNING || $st == JobState=COMPLETING ]] || break
  sleep 0.5
done
dump_job "$S2" "$OUT2"
code=$(in_ctl scontrol show job "$S2" -o | grep -o 'ExitCode=[0-9:]*' || true)
echo "serve job $S2 after scancel --batch --signal=TERM: $st $code"
[[ $st == JobState=COMPLETED && $code == ExitCode=0:0 ]] || fail "job $S2 did not drain to exit 0: $st $code"
grep -q "shut down cleanly" "$OUT2" || fail "job $S2: no clean shutdown line"
for ((i = 0; i < NR; i++)); do
  grep -Eq "router $i stopping: [1-9][0-9]* batches" "$OUT2" || fail "job $S2: router $i served nothing"
done
echo "PASS serve job ($NR routers) until scancel: moectl and verified clients from the ready file, drained on TERM, exit 0"

# 3. The benchmark job.
submit_wait bench env MOEBENCH_BIN="$MOEBENCH" MOEBENCH_MODEL="$SRC/tests/data/hf-moe/deepseek_v3" \
  MOEBENCH_TOKENS=1,16 MOEBENCH_OUT="$WORK/jobs/bench" \
  sbatch --wait --parsable --time=5 --cpus-per-task=2 --output="$WORK/jobs/bench-%j.out" \
  "$SRC/deploy/slurm/moebench.sbatch"
[[ $RC == 0 ]] || die_slurm "the bench job failed (sbatch --wait exit $RC)"
/usr/bin/python3 - "$WORK/jobs/bench/bench.json" <<'P' || fail "bench.json does not parse"
import json, sys
r = json.load(open(sys.argv[1]))
assert isinstance(r, dict) and r, "empty report"
print("bench.json keys:", ", ".join(sorted(r))[:200])
P
echo "PASS bench job: exit 0, bench.json parses"
echo "PASS slurm_sbatch$([[ $TWO == 1 ]] && echo ' (two nodes)')"
