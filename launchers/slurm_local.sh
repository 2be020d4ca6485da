#!/usr/bin/env bash
# A single-node SLURM cluster on localhost, for the slow tests and for trying hydra/launcher=slurm.
# Run (as root):  launchers/slurm_local.sh up | down | status
#
# `up` installs Debian's slurm-wlm, munge, slurmdbd and mariadb-server when they are missing,
# writes /etc/slurm/{slurm,slurmdbd,gres}.conf (marked as ours; a foreign slurm.conf is never
# overwritten), and starts munged, mariadbd, slurmdbd, slurmctld and slurmd without systemd.
# `down` cancels every job and stops those daemons (packages, configs and the job database stay).
#
# Why each non-default setting (measured on Debian 12, slurm 22.05, no systemd, no cgroups):
# - proctrack/linuxproc, task/none, jobacct_gather/none: need no cgroup hierarchy.
# - NodeAddr=127.0.0.1 and RealMemory from `slurmd -C`: more memory than the node has drains it.
# - SchedulerParameters below start a submitted job in under a second (default: several seconds).
# - AuthInfo=cred_expire=10: a requeued job restarts after ~11 s instead of ~2 minutes.
# - slurmdbd + MariaDB (accounting): without it submitit cannot tell that a cancelled job died
#   (sacct has nothing) and a sweep waits forever; with it the sweep raises within ~20 s.
# - GresTypes=gpu with File= symlinks to /dev/null: GPU-shaped requests (--gpus-per-node,
#   --gres=gpu:1) schedule on this GPU-less node. `Count=` alone (no File=) drains the node.
#
# Environment knobs: SLURM_LOCAL_FAKE_GPUS (default 2; 0 = no gres), SLURM_LOCAL_CLUSTER
# (default "local"), SLURM_LOCAL_PARTITION (default "debug").
set -euo pipefail

CLUSTER=${SLURM_LOCAL_CLUSTER:-local}
PARTITION=${SLURM_LOCAL_PARTITION:-debug}
FAKE_GPUS=${SLURM_LOCAL_FAKE_GPUS:-2}
ETC=/etc/slurm
RUN=/run/slurm_local            # pid files and the fake GPU device symlinks
LOG=/var/log/slurm
STATE=/var/lib/slurm
MARKER="# written by musique_rl launchers/slurm_local.sh"
DB_PASS=slurm_local_only        # the DB listens on the unix socket and 127.0.0.1 only
PACKAGES=(slurm-wlm munge slurmdbd mariadb-server)

log() { echo "[slurm_local] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for <seconds> <description> <command...>
  local secs=$1 what=$2; shift 2
  local t=0
  until "$@" >/dev/null 2>&1; do
    sleep 0.5; t=$((t + 1))
    if (( t > secs * 2 )); then die "timed out after ${secs}s waiting for $what"; fi
  done
}

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurm-wlm)
  command -v munged >/dev/null || missing+=(munge)
  command -v slurmdbd >/dev/null || missing+=(slurmdbd)
  command -v mariadbd >/dev/null || missing+=(mariadb-server)
  (( ${#missing[@]} == 0 )) && return 0
  log "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine has no package lists yet; `install` alone would find nothing.
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
  fi
  chown munge:munge /etc/munge/munge.key; chmod 0600 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged sh -c 'munge -n | unmunge'
}

start_mariadb() {
  if mariadb-admin --protocol=socket -u root status >/dev/null 2>&1; then return 0; fi
  mkdir -p /run/mysqld; chown mysql:mysql /run/mysqld
  [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  # Not daemonising itself: setsid detaches it from this shell so `up` can return.
  setsid runuser -u mysql -- /usr/sbin/mariadbd --datadir=/var/lib/mysql \
    --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/mysqld.pid \
    --bind-address=127.0.0.1 --log-error=$LOG/mariadb.log </dev/null >/dev/null 2>&1 &
  wait_for 60 mariadbd mariadb-admin --protocol=socket -u root status
  mariadb -u root <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL
}

ours_or_absent() {  # refuse to overwrite a slurm config someone else wrote
  [[ ! -e $1 ]] || grep -qF "$MARKER" "$1" || die "$1 exists and was not written by this script; not touching it"
}

write_configs() {
  local host cpus sockets cores threads mem
  host=$(hostname -s)
  # `slurmd -C` prints the node line slurmd itself will check against (CPUs, RealMemory ...).
  read -r cpus sockets cores threads mem < <(slurmd -C | head -1 | tr ' ' '\n' | awk -F= '
    /^CPUs=/ {c=$2} /^SocketsPerBoard=/ {s=$2} /^CoresPerSocket=/ {k=$2}
    /^ThreadsPerCore=/ {t=$2} /^RealMemory=/ {m=$2} END {print c, s, k, t, m}')
  mkdir -p $ETC $RUN $LOG $STATE/slurmctld $STATE/slurmd
  chown slurm:slurm $RUN $LOG $STATE/slurmctld
  for f in slurm.conf slurmdbd.conf gres.conf; do ours_or_absent $ETC/$f; done

  local gres_node="" gres_types=""
  : >"$ETC/gres.conf.tmp"
  echo "$MARKER" >>"$ETC/gres.conf.tmp"
  if (( FAKE_GPUS > 0 )); then
    gres_node="Gres=gpu:$FAKE_GPUS"; gres_types="GresTypes=gpu"
    for ((i = 0; i < FAKE_GPUS; i++)); do
      ln -sfn /dev/null "$RUN/fakegpu$i"
      echo "NodeName=$host Name=gpu File=$RUN/fakegpu$i" >>"$ETC/gres.conf.tmp"
    done
  fi
  mv "$ETC/gres.conf.tmp" "$ETC/gres.conf"

  cat >"$ETC/slurmdbd.conf" <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=slurm
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
  chown slurm:slurm "$ETC/slurmdbd.conf"; chmod 0600 "$ETC/slurmdbd.conf"

  cat >"$ETC/slurm.conf" <<EOF
$MARKER
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
JobRequeue=1
KillWait=5
InactiveLimit=0
$gres_types
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$mem $gres_node State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

register_accounting() {
  # The cluster must exist in the DB before slurmctld reports to it; an account and a user
  # association for the submitting user let sacct and --account work.
  local user=${SUDO_USER:-$(id -un)}
  sacctmgr -i -Q show cluster -n format=cluster | grep -qw "$CLUSTER" || sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null
  sacctmgr -i -Q show account -n format=account | grep -qw local || sacctmgr -i -Q add account local Cluster="$CLUSTER" Description=local Organization=local >/dev/null
  sacctmgr -i -Q show assoc -n format=user,account user="$user" | grep -qw local || sacctmgr -i -Q add user "$user" Account=local Cluster="$CLUSTER" >/dev/null
}

node_state() { sinfo -h -N -o %T 2>/dev/null | head -1; }

up() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts system daemons)"
  local t0=$SECONDS
  install_packages
  write_configs
  start_munge
  start_mariadb
  if ! pid_alive $RUN/slurmdbd.pid; then slurmdbd; fi
  wait_for 30 slurmdbd sacctmgr -Q show cluster
  register_accounting
  if ! pid_alive $RUN/slurmctld.pid; then slurmctld; fi
  wait_for 30 slurmctld scontrol ping
  if ! pid_alive $RUN/slurmd.pid; then slurmd; fi
  wait_for 30 "node registration" sh -c "sinfo -h -N -o %T | grep -Eq 'idle|mixed|allocated|drain|down'"
  case $(node_state) in
    *drain*|down*) scontrol update NodeName="$(hostname -s)" State=RESUME ;;
  esac
  wait_for 30 "node idle" sh -c "sinfo -h -N -o %T | grep -Eq '^(idle|mixed|allocated)'"
  log "up in $((SECONDS - t0)) s: cluster=$CLUSTER partition=$PARTITION node=$(hostname -s) fake_gpus=$FAKE_GPUS"
}

stop_pidfile() {  # stop_pidfile <pidfile> <name>
  if pid_alive "$1"; then
    local pid; pid=$(cat "$1")
    kill "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && { log "$2 ignored SIGTERM; SIGKILL"; kill -9 "$pid"; }
    log "stopped $2"
  fi
  return 0
}

down() {
  [[ $(id -u) -eq 0 ]] || die "must run as root"
  if scontrol ping >/dev/null 2>&1; then
    local jobs; jobs=$(squeue -h -o %A || true)
    [[ -n $jobs ]] && scancel $jobs || true
  fi
  stop_pidfile $RUN/slurmd.pid slurmd
  stop_pidfile $RUN/slurmctld.pid slurmctld
  stop_pidfile $RUN/slurmdbd.pid slurmdbd
  stop_pidfile /run/mysqld/mysqld.pid mariadbd
  stop_pidfile /run/munge/munged.pid munged
}

status() {
  local rc=0
  for d in munged:/run/munge/munged.pid mariadbd:/run/mysqld/mysqld.pid slurmdbd:$RUN/slurmdbd.pid \
           slurmctld:$RUN/slurmctld.pid slurmd:$RUN/slurmd.pid; do
    if pid_alive "${d#*:}"; then echo "${d%%:*}: running (pid $(cat "${d#*:}"))"; else echo "${d%%:*}: stopped"; rc=1; fi
  done
  if (( rc == 0 )); then sinfo -N -o "%N %P %T %c %m %G"; squeue; fi
  return $rc
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
