"""Write docs/configuration.md from the config schemas (kvpush.common.configschema), or check it.

    python scripts/config_reference.py            # rewrite docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 if it differs from the schemas

Why generated: every key of the daemon, the plugin and the router has its type, default and
meaning in one place, its dataclass field; the reference cannot drift from what loads.
tests/unit/test_configschema.py runs --check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpush.common.configschema import describe, markdown_table
from kvpush.daemon.config import (
    DEFAULT_CONFIG,
    DEVICE,
    NODE,
    TABLE,
    DeviceConfig,
    DeviceSelection,
    NodeConfig,
    env_var,
)
from kvpush.engine_plugin.config import PluginConfig
from kvpush.router.router_config import ADMIN_LISTEN_DOC, LISTEN_DOC, RouterConfig

OUT = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def render() -> str:
    node = describe(DeviceSelection, NODE) + describe(NodeConfig, NODE)
    device = describe(DeviceConfig, DEVICE)
    table = describe(DeviceConfig, TABLE)
    return f"""# Configuration reference

Generated from the config schemas by `scripts/config_reference.py`; do not edit by hand
(`tests/unit/test_configschema.py` fails when this file and the schemas differ). Types are
strict: in TOML, JSON and on the command line a value must have the key's type (`"false"` is
not a boolean, `"9470"` not an integer); only environment variables are text, converted.

## kvpushd

Read from, highest first: command-line flags (`--metrics-port`, ...: the key with `-` for
`_`), `KVPUSH_<KEY>` environment variables, the TOML file (`--config`, else `KVPUSH_CONFIG`,
else `{DEFAULT_CONFIG}` when it exists), then the defaults. `kvpushd print-config` shows the
effective configuration.

### Node keys (top level of the file)

{markdown_table(node)}
### Device keys (top level: every device's default; or per device in `[device.<name>]`)

{markdown_table(device)}
### Per-device keys (`[device.<name>]` only)

{markdown_table(table)}
Environment variables: the key in capitals after `KVPUSH_` (`{env_var("metrics_port")}`,
`{env_var("devices")}=cpu0,cpu1`).

## The connector (`kv_connector_extra_config` in vLLM's `--kv-transfer-config`)

A JSON object. `daemon` is required.

{markdown_table(describe(PluginConfig))}
## kvpush-router (`--config FILE`, TOML; flags override)

{markdown_table(describe(RouterConfig))}| `listen` | string | "127.0.0.1:8000" | {LISTEN_DOC} |
| `admin_listen` | string | "127.0.0.1:<listen's port + 1>" | {ADMIN_LISTEN_DOC} |

Engines: one `[[prefill]]` table per prefill engine (`url`, and either `host` + `base_port` +
`tp_size` (default 1) naming its node's kvpushd, rank r at `base_port + r`, or `endpoints`, a
list of `tcp://host:port` in rank order) and one `[[decode]]` table per decode engine (`url`,
and `node`: its node's certificate name, the only node the prefill daemon then lets register
the request's transfer; see [security.md](security.md)). Flags: `--prefill URL=HOST:BASE_PORT[,tp=N]` or
`URL=tcp://h:p[,...]`, `--decode URL[,node=NAME]` (added to the file's pools), `--listen`, `--admin-listen`,
`--policy`, `--prefill-timeout`, `--request-timeout`, `--shutdown-grace`, `--expose-transfer-id`.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} differs from the schemas: run python scripts/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
