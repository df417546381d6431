"""Commands on a topology before anything runs: validate, plan, render, model."""

import json
from pathlib import Path
from typing import Annotated

import typer

from pdctl import api, render
from pdctl import topology as topo_mod
from pdctl.cli.common import (
    JsonOpt,
    OutputOpt,
    StateDirOpt,
    TopologyArg,
    app,
    load_topology,
    model_app,
    out,
    render_app,
    say,
    topology_command,
)

BaselineOpt = Annotated[bool, typer.Option(help="bench --goodput's aggregated baseline on the same devices")]


@app.command()
@topology_command
def validate(topology: TopologyArg, json_: JsonOpt = False, overrides: list = ()) -> None:
    """Check a topology against every compatibility rule, before anything starts.

    Exit 0 when valid, 1 with every problem (file:line, field, how to fix) otherwise.

    Examples:

      pdctl validate configs/cpu-demo.yaml

      pdctl validate configs/cpu-demo.yaml --prefill-block-size 64 --decode-block-size 32

      pdctl validate configs/cpu-demo.yaml --set connector.kind=nixl --json
    """
    try:
        t = load_topology(topology, overrides)
    except topo_mod.TopologyError as e:
        if not json_:
            raise
        out.print_json(json.dumps({"ok": False, "file": str(topology), "problems": [
            {"path": ".".join(map(str, p.path)), "where": e.source.describe(p).split(": ", 1)[0],
             "message": p.message, "hint": p.hint} for p in e.problems]}))
        raise typer.Exit(1) from None
    summary = topo_mod.summary(t)
    if json_:
        out.print_json(json.dumps({"ok": True, "file": str(topology), "summary": summary}))
    else:
        out.print(f"[green]valid[/green] {summary}", highlight=False, soft_wrap=True)


@app.command()
@topology_command
def plan(topology: TopologyArg, json_: JsonOpt = False, output: OutputOpt = render.Output.default,
         state_dir: StateDirOpt = None, baseline: BaselineOpt = False, overrides: list = ()) -> None:
    """Show the exact processes `pdctl up` would start: argv, env, ports, log, readiness URL.

    Examples:

      pdctl plan configs/cpu-demo.yaml

      pdctl plan configs/qwen3-0.6b-cuda-d64.yaml --decode-tp 2 --json

      pdctl plan configs/cpu-slurm.yaml --set engine.kind=slurm -o wide
    """
    p = api.plan(load_topology(topology, overrides), state_dir=state_dir, baseline=baseline)
    render.plan(out, p, render.Output.json if json_ else output, api.slurm_batch(p))


@render_app.command("k8s")
@topology_command
def render_k8s(
    topology: TopologyArg,
    out_dir: Annotated[Path, typer.Option("-o", "--out", help="directory to write the manifests to")],
    image: Annotated[str, typer.Option(help="container image with vLLM, NIXL and pdctl installed")] = "",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace")] = "default",
    validate_: Annotated[bool, typer.Option("--validate/--no-validate", help="check every manifest offline with "
                                            "kubernetes-validate --strict")] = True,
    overrides: list = (),
) -> None:
    """Kubernetes manifests: a StatefulSet + headless Service per pool, the proxy, the topology as a ConfigMap.

    Accelerators are requested per platform (nvidia.com/gpu, habana.ai/gaudi, gpu.intel.com/i915) instead of
    device ids, and each pod's NIXL side-channel host is its pod IP. A local model path is mounted from the
    PersistentVolumeClaim 'pdctl-models' at /models. Validated offline; pdctl does not apply them.

    Examples:

      pdctl render k8s configs/cuda-to-gaudi.yaml -o k8s/ --image registry.example/pdctl-vllm:0.11

      pdctl render k8s configs/cpu-demo.yaml -o /tmp/k8s --namespace pd --decode-block-size 128
    """
    written = api.render_k8s(load_topology(topology, overrides), out_dir, image=image or None, namespace=namespace,
                             validate=validate_)
    checked = " (validated with kubernetes-validate --strict)" if validate_ else ""
    out.print(f"wrote {len(written)} manifests to {out_dir}{checked}", highlight=False)


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(help="directory to write the model to")],
    seed: Annotated[int, typer.Option(help="same seed, same weights and tokenizer")] = 0,
    force: Annotated[bool, typer.Option(help="rebuild even if DIR already holds this seed's model")] = False,
    hybrid: Annotated[bool, typer.Option(help="4 layers: sliding-window and full attention in turn")] = False,
    window: Annotated[int, typer.Option(min=1, help="with --hybrid: the sliding window, in tokens")] = 96,
) -> None:
    """Build a tiny random-weight Llama (2 layers, 2 KV heads, ~2k BPE vocab) offline, in seconds.

    Examples:

      pdctl model tiny .pdctl/models/tiny

      pdctl model tiny .pdctl/models/tiny-hybrid --hybrid --window 96
    """
    fingerprint = api.tiny_model(out_dir, seed=seed, force=force, say=say, window=window if hybrid else None)
    out.print(f"built {out_dir} (seed {seed}, fingerprint {fingerprint})" if fingerprint else
              f"tiny model already at {out_dir} (seed {seed}); --force rebuilds", highlight=False)
