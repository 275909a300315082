"""`mlxmtp add-mtp-weights`: put the MTP head back into a quantized MLX model folder."""

from pathlib import Path

import click


@click.command("add-mtp-weights")
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False),
              help="The MLX model folder to repair (its own shards are never touched).")
@click.option("--source", required=True,
              help="The BF16 checkpoint holding mtp.* tensors: a local folder or a Hugging Face repo id "
                   "(mlxmtp-demo: the demo model's own head, to repair a quantized copy of the demo offline).")
@click.option("--bits", default="auto", show_default=True,
              type=click.Choice(["auto", "2", "3", "4", "5", "6", "8", "16"]),
              help="Head bits; auto = like the model; 16 keeps the source dtype unquantized.")
@click.option("--group-size", default="auto", show_default=True, help="Group size; auto = like the model.")
@click.option("--mode", default="auto", show_default=True,
              type=click.Choice(["auto", "affine", "mxfp4", "nvfp4", "mxfp8"]),
              help="Quantization mode; auto = like the model.")
@click.option("--revision", default=None, help="Revision of the source repo (HF id only).")
@click.option("--dry-run", is_flag=True, help="Print the plan, write nothing.")
@click.option("--force", is_flag=True, help="Replace a head that is already there.")
def add_mtp_weights(model_dir, source, bits, group_size, mode, revision, dry_run, force):
    """Repair a quantized MLX model folder that lost its MTP head.

    Reads only the source shards holding mtp.* tensors, converts them as mlx-lm converts the
    main layers (norm +1 once, experts stacked / split), quantizes like the model (router and
    shared_expert_gate as the model's main layers), validates against the model, and writes
    MODEL/mtp/ atomically, on the CPU. Options are checked before any work, and a head that a
    killed earlier run left half-swapped is put back first.
    """
    # On use: `mlxmtp` start-up imports every subcommand module, and this one pulls in mlx_lm.
    from ..convert.add_mtp_weights import AddMTPError
    from ..convert.add_mtp_weights import add_mtp_weights as run
    from ..models import demo

    if demo.names_demo(model_dir):  # the packaged demo: by its name, or its folder
        if force:
            raise click.BadParameter("the demo model is part of the mlxmtp package and keeps the head it ships "
                                     "with: repair a copy of it (a quantized conversion) instead",
                                     param_hint="--model")
        model_dir = str(demo.demo_model_path())
    if group_size != "auto":
        try:
            group_size = int(group_size)
        except ValueError:
            group_size = 0
        if group_size <= 0:
            raise click.BadParameter("must be auto or a positive integer", param_hint="--group-size")
    if revision is not None and Path(source).expanduser().is_dir():
        raise click.BadParameter(f"applies to a Hugging Face repo id only; --source {source} is a local folder",
                                 param_hint="--revision")
    try:
        run(model_dir, source, bits=bits, group_size=group_size, mode=mode, dry_run=dry_run,
            force=force, revision=revision, echo=click.echo)
    except AddMTPError as e:
        raise click.ClickException(str(e)) from e
