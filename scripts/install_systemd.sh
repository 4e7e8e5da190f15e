#!/usr/bin/env bash
# Install kvpushd as a systemd service on this node (run as root, from a checkout):
#   sudo scripts/install_systemd.sh            kvpushd (one per node)
#   sudo scripts/install_systemd.sh --router   also kvpush-router (on the node that fronts the engines)
# Creates the kvpush system user/group, a virtualenv in /opt/kvpush/venv with this repo
# installed, the unit in /etc/systemd/system and the example config in
# /etc/kvpush/kvpushd.toml (an existing config is kept), then reloads systemd.
# Safe to run again after an upgrade. The daemons need the same torch build as the engines
# (CUDA IPC handles cross between them), pinned: nixl would otherwise pull the newest torch
# from the index. Say which, one of (docs/install.md, "Install matrix"):
#   VLLM_PYTHON=/opt/vllm/venv/bin/python   pin the torch version of the engines' venv
#   KVPUSH_TORCH="torch==2.9.0+cu128"       an explicit requirement
# (on an upgrade, the torch already in the venv is kept when neither is given). Environment:
#   PYTHON=python3.11      interpreter for the virtualenv (default: python3)
#   KVPUSH_PREFIX=/opt/kvpush
#   PIP_EXTRA="--index-url https://download.pytorch.org/whl/cu128"  extra pip arguments
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${KVPUSH_PREFIX:-/opt/kvpush}"
VENV="$PREFIX/venv"
PY="${PYTHON:-python3}"
UNIT_SRC="$ROOT/scripts/systemd/kvpushd.service"
CONF_SRC="$ROOT/scripts/systemd/kvpushd.toml"
UNIT_DST=/etc/systemd/system/kvpushd.service
ROUTER_UNIT_SRC="$ROOT/scripts/systemd/kvpush-router.service"
ROUTER_CONF_SRC="$ROOT/scripts/systemd/router.toml"
ROUTER=0
for arg in "$@"; do
  case $arg in
    --router) ROUTER=1 ;;
    *) echo "install_systemd: unknown argument $arg (known: --router)" >&2; exit 2 ;;
  esac
done
CONF_DIR=/etc/kvpush
CONF_DST="$CONF_DIR/kvpushd.toml"

die() {
  echo "install_systemd: $*" >&2
  exit 1
}

[[ $(id -u) -eq 0 ]] || die "run as root (it creates a user and writes /etc, /opt)"
command -v systemctl >/dev/null || die "systemctl not found: this script needs systemd"
[[ -f $UNIT_SRC && -f $CONF_SRC ]] || die "run from a kvpush checkout ($ROOT)"

# 0. Which torch the daemons get, decided before anything is changed on this host.
torch_version() {  # the torch version installed for interpreter $1, or nothing
  "$1" -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null || true
}
TORCH_SPEC="${KVPUSH_TORCH:-}"
if [[ -z $TORCH_SPEC && -n ${VLLM_PYTHON:-} ]]; then
  v="$(torch_version "$VLLM_PYTHON")"
  [[ -n $v ]] || die "VLLM_PYTHON=$VLLM_PYTHON has no torch"
  TORCH_SPEC="torch==$v"
fi
if [[ -z $TORCH_SPEC ]]; then
  v="$(torch_version "$VENV/bin/python")"
  [[ -n $v ]] && TORCH_SPEC="torch==$v"
fi
[[ -n $TORCH_SPEC ]] || die "say which torch the daemons use: VLLM_PYTHON=<the engines' venv>/bin/python or KVPUSH_TORCH='torch==X.Y.Z' (docs/install.md)"

# 1. The service account: a system user without login or home.
if ! getent group kvpush >/dev/null; then
  groupadd --system kvpush
fi
if ! getent passwd kvpush >/dev/null; then
  useradd --system --gid kvpush --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin --comment "kvpush daemons" kvpush
fi
# Device nodes that are not world-accessible belong to one of these groups.
for group in video render rdma; do
  if getent group "$group" >/dev/null; then
    usermod --append --groups "$group" kvpush
  fi
done

# 2. The code: a virtualenv owned by root (the service only reads it).
install -d -m 0755 "$PREFIX"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
read -r -a extra <<<"${PIP_EXTRA:-}"
extras=daemon
[[ $ROUTER == 1 ]] && extras=daemon,router
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
"$VENV/bin/python" -m pip install --disable-pip-version-check -q "${ROOT}[${extras}]" "$TORCH_SPEC" "${extra[@]}"
install -m 0644 "$ROOT/README.md" "$PREFIX/README.md"
[[ -x "$VENV/bin/kvpushd" ]] || die "$VENV/bin/kvpushd missing after pip install"
ln -sf "$VENV/bin/kvpushctl" /usr/local/bin/kvpushctl

# 3. Configuration: the example only if there is none yet.
install -d -m 0755 "$CONF_DIR"
if [[ -e $CONF_DST ]]; then
  echo "keeping existing $CONF_DST (the new example is $CONF_SRC)"
else
  install -m 0644 "$CONF_SRC" "$CONF_DST"
  echo "installed example config $CONF_DST: review devices, peer_host and ports"
fi
"$VENV/bin/kvpushd" --config "$CONF_DST" print-config >/dev/null ||
  die "$CONF_DST is not a valid kvpushd configuration"

# 4. Peer keys (authentication is on by default): this node's key pair, made once.
#    KVPUSH_NODE_HOSTS: the addresses this node's daemons advertise (default: all of this
#    host's addresses). Copy the public $CONF_DIR/<node>.key into every peer node's
#    $CONF_DIR/authorized_keys/ (docs/operating.md: "Keys by host name or address").
NODE="$(hostname -s)"
install -d -m 0750 -o root -g kvpush "$CONF_DIR/authorized_keys"
if [[ ! -e $CONF_DIR/node.key_secret ]]; then
  read -r -a hosts <<<"${KVPUSH_NODE_HOSTS:-$(hostname -I 2>/dev/null || echo 127.0.0.1)}"
  host_args=()
  for h in "${hosts[@]}"; do host_args+=(--host "$h"); done
  tmpk="$(mktemp -d)"
  "$VENV/bin/kvpushd" keygen --dir "$tmpk" --name "$NODE" "${host_args[@]}" >/dev/null
  install -m 0640 -o root -g kvpush "$tmpk/$NODE.key_secret" "$CONF_DIR/node.key_secret"
  install -m 0644 "$tmpk/$NODE.key" "$CONF_DIR/$NODE.key"
  install -m 0644 "$tmpk/$NODE.key" "$CONF_DIR/authorized_keys/$NODE.key"
  rm -rf "$tmpk"
  echo "made this node's peer keys: $CONF_DIR/node.key_secret (secret), $CONF_DIR/$NODE.key (public)"
else
  echo "keeping this node's peer keys in $CONF_DIR"
fi

# 5. The unit.
install -m 0644 "$UNIT_SRC" "$UNIT_DST"
if command -v systemd-analyze >/dev/null; then
  systemd-analyze verify "$UNIT_DST"
fi
if [[ $ROUTER == 1 ]]; then
  if [[ ! -e $CONF_DIR/router.toml ]]; then
    install -m 0644 "$ROUTER_CONF_SRC" "$CONF_DIR/router.toml"
    echo "installed example router config $CONF_DIR/router.toml: name your engines"
  fi
  install -m 0644 "$ROUTER_UNIT_SRC" /etc/systemd/system/kvpush-router.service
  if command -v systemd-analyze >/dev/null; then
    systemd-analyze verify /etc/systemd/system/kvpush-router.service
  fi
  echo "kvpush-router installed: systemctl enable --now kvpush-router"
fi
systemctl daemon-reload

cat <<EOF
kvpushd installed. Start it now and at every boot with:
  systemctl enable --now kvpushd
Engines (and operators running kvpushctl) need group kvpush: usermod -aG kvpush USER
Check it with: kvpushctl status    Logs: journalctl -u kvpushd
EOF
