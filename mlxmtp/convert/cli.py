"""`mlxmtp add-mtp-weights` (being implemented: see issue "add-mtp-weights")."""

import click


@click.command("add-mtp-weights")
def add_mtp_weights():
    """Repair a quantized MLX model folder that lost its MTP head."""
    raise click.ClickException("not implemented yet")
