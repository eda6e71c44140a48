#!/usr/bin/env bash
# Run a command inside a fresh cgroup with a CPU quota (what systemd's CPUQuota=, Docker's --cpus
# and Kubernetes' CPU limits write), then remove the cgroup. Needs root. Uses the cgroup v2 cpu
# controller where it is enabled, else the v1 cpu hierarchy (hybrid hosts such as this one).
# Usage: bench/cpu_quota.sh CPUS COMMAND...     e.g. bench/cpu_quota.sh 1 .venv/bin/python bench/bench_cpu.py ...
set -euo pipefail
CPUS=$1; shift
PERIOD=100000
QUOTA=$(awk -v c="$CPUS" -v p=$PERIOD 'BEGIN { printf "%d", c * p }')
V2=$(awk '$9 == "cgroup2" { print $5; exit }' /proc/self/mountinfo)
V1=$(awk '$9 == "cgroup" && $NF ~ /(^|,)cpu(,|$)/ { print $5; exit }' /proc/self/mountinfo)
if [ -n "$V2" ] && grep -qw cpu "$V2/cgroup.subtree_control" 2>/dev/null; then
  CG="$V2/chattts-bench-$$"; mkdir "$CG"; echo "$QUOTA $PERIOD" > "$CG/cpu.max"
elif [ -n "$V1" ]; then
  CG="$V1/chattts-bench-$$"; mkdir "$CG"; echo $PERIOD > "$CG/cpu.cfs_period_us"; echo "$QUOTA" > "$CG/cpu.cfs_quota_us"
else
  echo "no cgroup hierarchy with the cpu controller" >&2; exit 2
fi
cleanup() { while read -r p; do echo "$p" > "$(dirname "$CG")/cgroup.procs" 2>/dev/null || true; done < "$CG/cgroup.procs"; rmdir "$CG"; }
trap cleanup EXIT
echo "cgroup $CG: quota $QUOTA / $PERIOD us ($CPUS CPUs)" >&2
sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$CG" "$@"
