"""`mlxmtp inspect`: what a model folder holds, without loading its weights."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("model", required=False)
@click.option("--ranks", default=1, show_default=True, type=click.IntRange(min=1),
              help="Also plan a distributed run on N ranks: layers, files and bytes of weights per rank.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(model, as_json, ranks=1):
    """Family, quantization and MTP head (present? where? layers, expert layout) of MODEL: a
    model folder or Hugging Face repo id (default: the demo model, mlxmtp-demo)."""
    # On use: `mlxmtp` start-up imports every subcommand module
    from ..checkpoint.split_plan import make_plan
    from ..models import demo
    from ..models.inspection import inspect_model

    try:
        info = inspect_model(model or demo.NAME)
        if ranks > 1:
            info["distributed"] = make_plan(Path(info["path"]), ranks).as_dict()
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(info))
        return
    q = info["quantization"]
    m = info["mtp"]
    click.echo(f"model:        {info['path']}")
    click.echo(f"family:       {info['family']}")
    click.echo(f"quantization: {'none (' + str(info['dtype']) + ')' if q is None else q}")
    if m["present"]:
        click.echo(f"MTP head:     present, {m['layers']} layer(s), at {m['location']}")
        click.echo(f"  experts:    {m['expert_layout']} ({m.get('num_experts', 0)} experts)")
        click.echo(f"  hidden:     {m['hidden_state']}")
    else:
        click.echo(f"MTP head:     MISSING (repair with `mlxmtp add-mtp-weights --model {info['path']} "
                   "--source BF16_SOURCE`)")
    for r in info.get("distributed", {}).get("ranks", []):
        click.echo(f"rank {r['rank']}:       layers {r['layers'][0]}-{r['layers'][1] - 1}, "
                   f"{r['bytes'] / 2**30:.2f} GiB of weights, {len(r['files'])} file(s)")
