"""`mlxmtp inspect`: what a model folder holds, without loading its weights."""

from __future__ import annotations

import json

import click


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(model, as_json):
    """Family, quantization and MTP head (present? where? layers, expert layout) of MODEL."""
    from .load import inspect_model  # on use: `mlxmtp` start-up imports every subcommand module

    try:
        info = inspect_model(model)
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
        click.echo("MTP head:     MISSING (repair with `mlxmtp add-mtp-weights --model MODEL --source BF16_SOURCE`)")
