"""The trainer's set-up of the process: the process group, the device and the check that
the run's folders can be written (:class:`TrainerSetup`, a mixin of
:class:`~comera_rec.training.engine.Trainer`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from comera_rec.training.dist import process_rank, restart_count
from comera_rec.training.trainer_config import TrainerConfig


class TrainerSetup:
    """Mixin of :class:`~comera_rec.training.engine.Trainer`: the set-up before a run.

    It relies on these attributes of the trainer: ``config`` and ``run_dir``; it sets
    ``_owns_group`` when it made the process group (``close()`` destroys that one only).
    """

    config: TrainerConfig
    run_dir: Path
    _owns_group: bool

    def _init_distributed(self) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            backend = self.config.backend
            if backend == "auto":
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            restarts = restart_count()
            if restarts > 0 and "MASTER_ADDR" in os.environ:
                # torchrun keeps one store across restarts; keys left by the killed attempt
                # (peer addresses) would make the new group connect to dead processes
                rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
                agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                store = dist.TCPStore(
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    world,
                    is_master=not agent_store and rank == 0,
                )
                dist.init_process_group(
                    backend,
                    store=dist.PrefixStore(f"comera_rec/attempt_{restarts}", store),
                    rank=rank,
                    world_size=world,
                )
            else:
                dist.init_process_group(backend)
            self._owns_group = True

    def _device(self) -> torch.device:
        name = self.config.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"trainer.device={self.config.device!r} asks for a GPU, but CUDA is not available "
                f"here (no GPU, no driver, or a CPU-only torch build); set trainer.device=cpu, "
                f"or auto to use a GPU only where there is one"
            )
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"trainer.device={self.config.device!r}, but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s): cuda:0 .. "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def _check_writable(self) -> None:
        """Fail before training when the run's folders cannot be written: ``run_dir`` (rank 0
        writes the log, plots and summary there) and, with checkpoints on
        (``checkpoint_at_end`` or ``checkpoint_every``), its ``checkpoints/`` folder, which
        every process writes its rank file into. Both are created when missing.

        Raises:
            OSError: naming trainer.run_dir, the folder and the reason (a file in the way,
                no permission, a read-only file system).
        """
        cfg = self.config
        folders = [self.run_dir] if process_rank() == 0 else []
        if cfg.checkpoint_at_end or cfg.checkpoint_every:
            folders.append(self.run_dir / "checkpoints")
        for folder in folders:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix=f".write-test-rank{process_rank()}-", dir=folder)
                os.close(fd)
                os.unlink(probe)
            except OSError as e:
                what = (
                    "checkpoints are on (trainer.checkpoint_at_end / checkpoint_every), and "
                    if folder != self.run_dir
                    else ""
                )
                raise OSError(
                    e.errno,
                    f"trainer.run_dir={cfg.run_dir!r}: {what}cannot write into {folder} "
                    f"({e.strerror or e}); choose a writable trainer.run_dir",
                ) from e
