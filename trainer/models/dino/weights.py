"""Fine-tuning from an upstream DINO checkpoint (IDEA-Research/DINO, e.g. ``checkpoint0011_4scale.pth``).

:func:`load_upstream` ``(model, path)`` copies the tensors of upstream's ``model`` state_dict into a
:class:`~trainer.models.dino.DINO` and returns a :class:`InitReport` (one summary line for the log, details for
whatever was not loaded):

- the file: upstream's ``{"model", "optimizer", "lr_scheduler", "epoch", "args"}`` (``args`` an
  ``argparse.Namespace``, allowed in ``torch.load(weights_only=True)``), or a bare state_dict; a ``module.``
  (DDP) or ``_orig_mod.`` (torch.compile) prefix is stripped. A file with other pickled objects is loaded with
  ``weights_only=False`` only after the log says so (that runs the file's pickled code: trusted files only).
- names: :data:`UPSTREAM_TO_OURS` maps upstream names to ours; empty, as no name differs (package docstring).
  Shared modules (``dec_pred_{bbox,class}_embed_share``: ``bbox_embed.<i>`` and ``transformer.decoder.bbox_embed.
  <i>`` are one module) appear under every name in both state_dicts; any one of those names in the file loads
  the shared tensor, so a file that lists a shared head under one name only loads too.
- shapes: a tensor whose shape differs is skipped and reported, except the class heads (``class_embed.*``,
  ``transformer.decoder.class_embed.*``, ``transformer.enc_out_class_embed.*``) and ``label_enc.weight`` when only
  the class dimension differs (e.g. COCO's 91 classes into 2): those keep their fresh initialisation, reported
  as re-initialised.
- a wrong model (fewer than half of the model's tensors loadable) raises ValueError naming what differs
  (backbone, hidden_dim, layers, queries: read from the file's shapes), before any tensor is copied.
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainer.errors import error_detail

#: Upstream state_dict name -> ours: ``(regex, replacement)`` rows applied in order with :func:`re.sub` to every
#: key of the file. Empty: no parameter or buffer name differs today (see the package docstring); add a row
#: here when one does.
UPSTREAM_TO_OURS: tuple[tuple[str, str], ...] = ()
#: Wrapper prefixes stripped from the file's keys (DDP's ``module.``, torch.compile's ``_orig_mod.``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: Keys whose first dimension is the class count: re-initialised instead of skipped when only it differs.
CLASS_HEAD = re.compile(
    r"^(class_embed\.\d+|transformer\.decoder\.class_embed\.\d+|transformer\.enc_out_class_embed)\.(weight|bias)$"
)
LABEL_ENC = "label_enc.weight"
#: How many names a detail line lists before "... and N more".
SHOW = 5

_BACKBONES = {(False, 2): "resnet18", (False, 6): "resnet34", (True, 6): "resnet50", (True, 23): "resnet101"}


@dataclass
class InitReport:
    """What :func:`load_upstream` did, per state_dict key of the model (shared tensors count under each name)."""

    path: str
    loaded: list[str] = field(default_factory=list)
    reinitialised: list[str] = field(default_factory=list)
    skipped: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # (key, file shape, model shape)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    num_classes: int = 0  # the model's
    checkpoint_classes: int | None = None  # the file's (class_embed rows), None when it has no class head
    label_enc_rows: int | None = None  # the file's label_enc rows

    def summary(self) -> str:
        """One line, e.g. ``init_from: loaded 599 tensors; re-initialised 27 (class heads, label_enc: 2 classes
        vs 91); skipped 0; missing 0; unexpected 0``."""
        reinit = f"re-initialised {len(self.reinitialised):,}"
        if self.reinitialised:
            kinds = [
                k
                for k, hit in (
                    ("class heads", any(CLASS_HEAD.match(n) for n in self.reinitialised)),
                    ("label_enc", LABEL_ENC in self.reinitialised),
                )
                if hit
            ]
            if self.checkpoint_classes is not None and self.checkpoint_classes != self.num_classes:
                why = f"{self.num_classes} classes vs {self.checkpoint_classes}"
            else:
                why = f"label_enc has {self.label_enc_rows} rows in the file vs {self.num_classes + 1}"
            reinit += f" ({', '.join(kinds)}: {why})"
        return (
            f"init_from: loaded {len(self.loaded):,} tensors; {reinit}; skipped {len(self.skipped):,}; "
            f"missing {len(self.missing):,}; unexpected {len(self.unexpected):,}"
        )

    def lines(self) -> list[str]:
        """The summary, then one line per non-empty category (first :data:`SHOW` names and the count) and the
        notes."""
        out = [self.summary()]
        if self.skipped:
            out.append(
                "init_from: skipped (shape differs; kept their initialisation): "
                + _first(f"{k} (file {tuple(a)}, model {tuple(b)})" for k, a, b in self.skipped)
            )
        if self.missing:
            out.append("init_from: missing from the file (kept their initialisation): " + _first(self.missing))
        if self.unexpected:
            out.append("init_from: unexpected (in the file, not in this model; ignored): " + _first(self.unexpected))
        out.extend(f"init_from: {n}" for n in self.notes)
        return out


def _first(names) -> str:
    names = list(names)
    more = f" ... and {len(names) - SHOW:,} more" if len(names) > SHOW else ""
    return ", ".join(names[:SHOW]) + more


def init_file(path: str | Path) -> Path:
    """The file ``init_from`` names: ``path`` itself when it is a file; for one of our checkpoint folders
    (``ckpt-*``, as ``--resume`` and ``predict`` take) its ``state.pt``; for a checkpoint_dir, the ``state.pt`` of
    the checkpoint its ``latest`` pointer names. Our ``state.pt`` holds the weights under ``model``, as
    upstream's files do.

    Raises:
        ValueError: nothing there, or a folder that is neither a checkpoint nor a checkpoint_dir with ``latest``.
    """
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir() and (p / "latest").is_file():
        p = p / (p / "latest").read_text().strip()
    if (p / "state.pt").is_file():
        return p / "state.pt"
    raise ValueError(
        f"{path} is not a file or a checkpoint folder (an upstream DINO checkpoint such as checkpoint0011_4scale.pth, "
        "a DINO state_dict saved with torch.save, or a ckpt-* folder / checkpoint_dir of ours)"
    )


def read_checkpoint(path: str | Path, log: Callable[[str], Any] = print) -> tuple[dict[str, Tensor], dict]:
    """The model state_dict in ``path`` (keys as stored, wrapper prefixes stripped) and the file's other top-level
    entries that are plain values (``epoch``).

    Raises:
        ValueError: the file is missing or unreadable, or holds no state_dict.
    """
    p = init_file(path)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if not found:
            raise ValueError(f"{path} could not be read by torch.load: {_one_line(e)}") from None
        log(
            f"init_from: {path} holds pickled objects besides tensors and argparse.Namespace ({found.group(1)}); "
            "loading it with weights_only=False, which runs code stored in the file: use only files you trust"
        )
        try:
            obj = torch.load(p, map_location="cpu", weights_only=False)
        except Exception as e2:  # noqa: BLE001 - any failure of an untrusted pickle is "unreadable"
            raise ValueError(f"{path} could not be read by torch.load: {_one_line(e2)}") from None
    except Exception as e:  # noqa: BLE001 - torch.load raises RuntimeError, EOFError, OSError ... on bad files
        raise ValueError(f"{path} could not be read by torch.load: {_one_line(e)}") from None

    meta: dict = {}
    if isinstance(obj, Mapping) and "model" in obj:
        meta = {k: v for k, v in obj.items() if k == "epoch" and isinstance(v, int)}
        sd = obj["model"]
        where = f"{path}['model']"
    else:
        sd, where = obj, str(path)
    if not isinstance(sd, Mapping) or not sd:
        kind = type(sd).__name__ if not isinstance(sd, Mapping) else "an empty dict"
        raise ValueError(f"{where} is not a state_dict (got {kind}; expected a dict of tensors or {{'model': ...}})")
    bad = next((k for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, Tensor)), None)
    if bad is not None:
        keys = ", ".join(map(repr, list(sd)[:5]))
        raise ValueError(
            f"{where} is not a state_dict: {bad!r} holds a {type(sd[bad]).__name__}, not a tensor (keys: {keys} ...)"
        )
    return {_strip(k): v for k, v in sd.items()}, meta


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key


def _one_line(e: BaseException) -> str:
    return error_detail(e, 300)


def to_our_names(sd: Mapping[str, Tensor]) -> dict[str, tuple[str, Tensor]]:
    """``{our name: (upstream name, tensor)}`` through :data:`UPSTREAM_TO_OURS`."""
    out = {}
    for key, t in sd.items():
        name = key
        for pattern, repl in UPSTREAM_TO_OURS:
            name = re.sub(pattern, repl, name)
        out[name] = (key, t)
    return out


def describe(shapes: Mapping[str, tuple]) -> dict[str, Any]:
    """Architecture read from a state_dict's shapes (our / upstream names): backbone, hidden_dim, feature levels,
    dim_feedforward, encoder/decoder layers, queries, classes. Entries that cannot be told are left out."""

    def count(prefix: str) -> int:
        return len({k[len(prefix) :].split(".", 1)[0] for k in shapes if k.startswith(prefix)})

    info: dict[str, Any] = {}
    blocks = count("backbone.0.body.layer3.")
    if blocks:
        bottleneck = "backbone.0.body.layer1.0.conv3.weight" in shapes
        info["backbone"] = _BACKBONES.get((bottleneck, blocks), f"a ResNet with {blocks} layer3 blocks")
    if "transformer.level_embed" in shapes and len(shapes["transformer.level_embed"]) == 2:
        info["num_feature_levels"], info["hidden_dim"] = shapes["transformer.level_embed"]
    if "transformer.encoder.layers.0.linear1.weight" in shapes:
        info["dim_feedforward"] = shapes["transformer.encoder.layers.0.linear1.weight"][0]
    for name, prefix in (("enc_layers", "transformer.encoder.layers."), ("dec_layers", "transformer.decoder.layers.")):
        if count(prefix):
            info[name] = count(prefix)
    if "transformer.tgt_embed.weight" in shapes:
        info["num_queries"] = shapes["transformer.tgt_embed.weight"][0]
    for key in ("class_embed.0.bias", "transformer.decoder.class_embed.0.bias", "transformer.enc_out_class_embed.bias"):
        if key in shapes:
            info["num_classes"] = shapes[key][0]
            break
    return info


def _differences(file_info: dict, model_info: dict) -> str:
    diffs = [
        f"{k} {file_info[k]} vs {model_info[k]}"
        for k in model_info
        if k != "num_classes" and k in file_info and file_info[k] != model_info[k]
    ]
    return "; ".join(diffs)


def load_upstream(model: nn.Module, path: str | Path, log: Callable[[str], Any] = print) -> InitReport:
    """Copy the tensors of the upstream DINO checkpoint ``path`` into ``model`` (see the module docstring) and
    log :meth:`InitReport.lines` through ``log``.

    Returns:
        The :class:`InitReport` (``summary()`` is the one line for the run's log).

    Raises:
        ValueError: one line: the file is missing or unreadable, holds no state_dict, or fewer than half of the
            model's tensors can be loaded from it (a different architecture: the message names what differs).
            The model is unchanged then.
    """
    raw = getattr(model, "module", model)
    file_sd, meta = read_checkpoint(path, log)
    theirs = to_our_names(file_sd)
    ours = raw.state_dict(keep_vars=True)
    num_classes = int(getattr(raw, "num_classes", 0))
    file_shapes = {k: tuple(t.shape) for k, (_, t) in theirs.items()}
    file_info = describe(file_shapes)
    report = InitReport(
        str(path),
        num_classes=num_classes,
        checkpoint_classes=file_info.get("num_classes"),
        label_enc_rows=file_shapes[LABEL_ENC][0] if LABEL_ENC in file_shapes else None,
    )

    # names of one tensor (shared modules are listed under each of their names)
    groups: dict[int, list[str]] = {}
    for key, t in ours.items():
        groups.setdefault(id(t), []).append(key)

    plan: list[tuple[Tensor, Tensor]] = []  # (model tensor, file tensor)
    for names in groups.values():
        target = ours[names[0]]
        present = [k for k in names if k in theirs]
        if not present:
            report.missing.extend(names)
            continue
        fits = [k for k in present if tuple(theirs[k][1].shape) == tuple(target.shape)]
        if fits:
            src = theirs[fits[0]][1]
            plan.append((target, src))
            report.loaded.extend(names)
            for k in present:
                if k not in fits:
                    report.skipped.append((k, file_shapes[k], tuple(target.shape)))
            differ = [k for k in fits[1:] if not torch.equal(theirs[k][1], src)]
            if differ:
                report.notes.append(
                    f"{', '.join(differ)} differ from {fits[0]} in the file but are one shared tensor in this model "
                    f"(dec_pred_*_embed_share): loaded {fits[0]}"
                )
            continue
        shape, fshape = tuple(target.shape), file_shapes[present[0]]
        is_head = all(CLASS_HEAD.match(k) or k == LABEL_ENC for k in names)
        if is_head and len(shape) == len(fshape) and shape[1:] == fshape[1:]:
            report.reinitialised.extend(names)
        else:
            report.skipped.extend((k, file_shapes[k], shape) for k in names if k in theirs)
            report.missing.extend(k for k in names if k not in theirs)
    report.unexpected = [theirs[k][0] for k in theirs if k not in ours]

    if len(report.loaded) * 2 < len(ours):
        diffs = _differences(file_info, describe({k: tuple(t.shape) for k, t in ours.items()}))
        raise ValueError(
            f"only {len(report.loaded):,} of this model's {len(ours):,} tensors can be loaded from {path} "
            f"({len(report.skipped):,} differ in shape, {len(report.missing):,} are not in the file); "
            + (
                f"the checkpoint is another architecture (file vs this model: {diffs})"
                if diffs
                else "is it a DINO checkpoint?"
            )
        )

    with torch.no_grad():
        for target, src in plan:
            target.copy_(src)

    epoch = f", epoch {meta['epoch']}" if "epoch" in meta else ""
    report.notes.insert(0, f"read {path} ({len(file_sd):,} tensors{epoch})")
    if report.skipped:
        diffs = _differences(file_info, describe({k: tuple(t.shape) for k, t in ours.items()}))
        if diffs:
            report.notes.append(f"the checkpoint differs from this model: {diffs}")
    for line in report.lines():
        log(line)
    return report
