"""What a SageMaker training container is told: the ``/opt/ml`` tree and the ``SM_*`` variables.

Read by the image's ``train`` entrypoint (:mod:`trainer.sagemaker.entrypoint`). The root is ``$TRAINSTACK_SM_ROOT``
(default ``/opt/ml``) so tests use a temporary tree. Files (SageMaker "Use your own training algorithms"):

- ``input/config/resourceconfig.json``: ``current_host``, ``hosts``, ``network_interface_name``
- ``input/config/hyperparameters.json``: {name: string}; the SDK may JSON-encode strings (``"\\"cosine\\""``)
- ``input/config/inputdataconfig.json`` and ``input/data/<channel>/``: the data channels
- ``checkpoints/`` (synced to S3), ``model/`` (uploaded as model.tar.gz), ``output/failure`` (reason text)

``SM_HOSTS``, ``SM_CURRENT_HOST``, ``SM_NUM_GPUS``, ``SM_MODEL_DIR``, ``SM_NETWORK_INTERFACE_NAME`` and
``SM_CHANNEL_<NAME>`` (set by SageMaker's training toolkit and by local mode) override the files.
Without ``resourceconfig.json`` or ``SM_CURRENT_HOST`` (plain ``docker run`` on EC2) the job is one host.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from trainer.config import FIELDS, TrainConfig

ROOT_ENV = "TRAINSTACK_SM_ROOT"
DEFAULT_ROOT = "/opt/ml"


class JobConfigError(ValueError):
    """A SageMaker input file or hyperparameter is malformed; the message names the file and key."""


@dataclass
class JobEnv:
    """One container's view of its job. Paths are absolute; hosts are sorted (SageMaker's algo-1..n)."""

    root: Path
    in_job: bool
    hosts: list[str]
    current_host: str
    hyperparameters: dict = field(default_factory=dict)
    channels: dict = field(default_factory=dict)  # name -> Path
    num_gpus: Optional[int] = None
    network_interface: Optional[str] = None
    model_dir: Path = Path(DEFAULT_ROOT, "model")

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    @property
    def node_rank(self) -> int:
        """Index of this host among the sorted hosts (0 = the rendezvous master)."""
        return self.hosts.index(self.current_host)

    @property
    def master_addr(self) -> str:
        return self.hosts[0]

    @property
    def failure_file(self) -> Path:
        return self.root / "output" / "failure"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def log_dir(self) -> Path:
        return self.root / "output" / "data" / "logs"


def _read_json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        raise JobConfigError(f"{path}: not readable JSON ({e})") from None


def _env_json(env: Mapping[str, str], name: str):
    try:
        return json.loads(env[name])
    except ValueError as e:
        raise JobConfigError(f"${name}: not JSON ({e}): {env[name]!r}") from None


def read_job_env(root: Optional[str | Path] = None, env: Optional[Mapping[str, str]] = None) -> JobEnv:
    """Read the job's hosts, hyperparameters and channels from ``root`` (default $TRAINSTACK_SM_ROOT).

    Raises:
        JobConfigError: unreadable JSON, current host not among the hosts, or a non-integer SM_NUM_GPUS.
    """
    env = os.environ if env is None else env
    root = Path(root or job_root(env)).resolve()
    cfg_dir = root / "input" / "config"
    rc_path = cfg_dir / "resourceconfig.json"
    resource = _read_json(rc_path, {})
    if not isinstance(resource, dict):
        raise JobConfigError(f"{rc_path}: expected a JSON object, got {type(resource).__name__}")
    hosts = _env_json(env, "SM_HOSTS") if "SM_HOSTS" in env else resource.get("hosts")
    current = env.get("SM_CURRENT_HOST") or resource.get("current_host")
    if current is None:
        current, hosts = "localhost", ["localhost"]
    hosts = sorted(str(h) for h in (hosts or [current]))
    if current not in hosts:
        raise JobConfigError(f"{rc_path}: current_host {current!r} is not among hosts {hosts}")
    hp_path = cfg_dir / "hyperparameters.json"
    hps = _read_json(hp_path, {})
    if not isinstance(hps, dict):
        raise JobConfigError(f"{hp_path}: expected a JSON object of name -> string, got {type(hps).__name__}")
    num_gpus = None
    if env.get("SM_NUM_GPUS"):
        try:
            num_gpus = int(env["SM_NUM_GPUS"])
        except ValueError:
            raise JobConfigError(f"$SM_NUM_GPUS: expected an integer, got {env['SM_NUM_GPUS']!r}") from None
    data_root = root / "input" / "data"
    names = set(_read_json(cfg_dir / "inputdataconfig.json", {}) or {})
    names |= {p.name for p in data_root.iterdir() if p.is_dir()} if data_root.is_dir() else set()
    env_channels = {k[len("SM_CHANNEL_") :].lower(): Path(v) for k, v in env.items() if k.startswith("SM_CHANNEL_")}
    channels = {n: data_root / n for n in sorted(names)}
    channels.update(env_channels)
    return JobEnv(
        root=root,
        in_job=in_job(root, env),
        hosts=hosts,
        current_host=current,
        hyperparameters=hps,
        channels=channels,
        num_gpus=num_gpus,
        network_interface=env.get("SM_NETWORK_INTERFACE_NAME") or resource.get("network_interface_name"),
        model_dir=Path(env.get("SM_MODEL_DIR") or root / "model"),
    )


def _decode(value):
    """A hyperparameter value as text: SageMaker stores strings, the SDK may JSON-encode them once more."""
    if isinstance(value, str) and value.startswith('"'):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    return value


_FLAG_OF = {name: name for name in FIELDS}
_FLAG_OF.update({alias: name for name, f in FIELDS.items() for alias in f.metadata.get("aliases", ())})


def hyperparameter_flags(hps: Mapping[str, object], source: str = "hyperparameters.json") -> list[str]:
    """Trainer flags for SageMaker hyperparameters.

    ``batch_size`` or ``batch-size`` -> ``--batch-size VALUE``; a boolean field takes "true"/"false" (any case)
    -> ``--x``/``--no-x``; ``config`` -> ``--config``; ``amp`` "true"/"false" -> ``--amp``/``--no-amp``;
    ``sagemaker_*`` keys (the SDK's own) are ignored; a JSON null leaves the field at its default.

    Raises:
        JobConfigError: unknown key, or a boolean field whose value is not "true"/"false"; names the key.
    """
    flags: list[str] = []
    for key in sorted(hps):
        value = _decode(hps[key])
        name = key.replace("-", "_")
        if name.startswith("sagemaker_") or value is None or value == "null":
            continue
        if name == "config":
            flags += ["--config", str(value)]
            continue
        is_bool = name == "amp" or (name in _FLAG_OF and isinstance(FIELDS[_FLAG_OF[name]].default, bool))
        if name not in _FLAG_OF and name != "amp":
            raise JobConfigError(
                f"{source}: unknown hyperparameter {key!r}; expected a trainer field such as "
                "'batch_size' or 'epochs' (python -m trainer train --help lists them), 'config', "
                "or a sagemaker_* key"
            )
        if isinstance(value, (list, dict)):
            raise JobConfigError(f"{source}: {key}: got {value!r}; expected a single value")
        flag = "--" + name.replace("_", "-")
        if is_bool:
            text = str(value).strip().lower()
            if text not in ("true", "false"):
                raise JobConfigError(f'{source}: {key}: got {value!r}; expected "true" or "false"')
            flags.append(flag if text == "true" else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def data_dir_for(job: JobEnv, train_split: str = "train", val_split: str = "val") -> Optional[Path]:
    """The ImageFolder root from the data channels, or None when there are none.

    Channels named after both splits (``train`` and ``val``) are the splits of ``input/data`` itself; one
    channel, or a channel named ``training``, is the root (holding ``train/`` and ``val/``).

    Raises:
        JobConfigError: several channels and none of these rules picks one.
    """
    ch = job.channels
    if not ch:
        return None
    if train_split in ch and val_split in ch:
        roots = {ch[train_split].parent, ch[val_split].parent}
        if len(roots) == 1 and ch[train_split].name == train_split and ch[val_split].name == val_split:
            return roots.pop()
    if len(ch) == 1:
        return next(iter(ch.values()))
    if "training" in ch:
        return ch["training"]
    raise JobConfigError(
        f"data channels {sorted(ch)}: cannot tell which is the ImageFolder root; use one "
        f"channel, a 'training' channel, channels '{train_split}' and '{val_split}', or set the "
        "data_dir hyperparameter"
    )


#: Periodic checkpoint interval (minutes) turned on inside a job: SIGTERM may not reach the training process.
DEFAULT_PERIODIC_MINUTES = 10.0


def job_root(env: Optional[Mapping[str, str]] = None) -> Path:
    """The SageMaker root: ``$TRAINSTACK_SM_ROOT``, default ``/opt/ml`` (the only place it is decided)."""
    env = os.environ if env is None else env
    return Path(env.get(ROOT_ENV) or DEFAULT_ROOT)


def in_job(root: Optional[str | Path] = None, env: Optional[Mapping[str, str]] = None) -> bool:
    """True inside a SageMaker training container: ``SM_TRAINING_ENV`` or ``SM_CURRENT_HOST`` is set (the
    training toolkit, local mode), or ``<root>/input/config/resourceconfig.json`` exists (every training job;
    AWS docs, "How Amazon SageMaker Provides Training Information"). The one rule used by the trainer and the
    image's entrypoint. ``root`` defaults to :func:`job_root`.
    """
    env = os.environ if env is None else env
    if env.get("SM_TRAINING_ENV") or env.get("SM_CURRENT_HOST"):
        return True
    return (Path(root) if root is not None else job_root(env)).joinpath("input/config/resourceconfig.json").is_file()


def apply_defaults(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """Return ``cfg`` with SageMaker defaults for fields left at their defaults, and log lines saying so."""
    if not in_job():
        return cfg, []
    changes, notes = {}, []
    if cfg.checkpoint_dir == FIELDS["checkpoint_dir"].default:
        changes["checkpoint_dir"] = str(job_root() / "checkpoints")
    if cfg.checkpoint_every_minutes == 0 and cfg.checkpoint_every_steps == 0:
        changes["checkpoint_every_minutes"] = DEFAULT_PERIODIC_MINUTES
    for k, v in changes.items():
        notes.append(f"sagemaker: {k}={v} (SageMaker syncs /opt/ml/checkpoints to S3; SIGTERM may not arrive)")
    return dataclasses.replace(cfg, **changes), notes
