"""`mlxmtp serve` (being implemented: see issue "mlxmtp serve")."""

import click


@click.command()
def serve():
    """OpenAI- and Anthropic-compatible server."""
    raise click.ClickException("not implemented yet")
