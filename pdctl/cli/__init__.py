"""pdctl's command line: parse, call one function of the Python API (pdctl.api), render (pdctl.render).

One module per subject; each registers its commands on `app` when imported, in the order `--help` lists them."""

import sys

from pdctl import api, render
from pdctl import topology as topo_mod
from pdctl.api import UserError

# isort: off
from pdctl.cli import topology, deploy, gates, bench  # noqa: F401
# isort: on
from pdctl.cli.common import app, err, out, say

__all__ = ["app", "err", "main", "out", "say", "UserError"]


def main() -> None:
    try:
        api.refuse_renamed(sys.argv[1:])
        app(standalone_mode=True)
    except topo_mod.TopologyError as e:
        err.print(e.render(), markup=False, highlight=False)
        sys.exit(1)
    except api.LaunchFailed as e:
        render.launch_failed(err, e)
        sys.exit(1)
    except UserError as e:
        err.print(f"error: {e}", markup=False, highlight=False)
        sys.exit(1)
