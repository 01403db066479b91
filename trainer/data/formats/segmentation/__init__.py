"""Semantic segmentation data (image/mask pairs): :mod:`.pairs` finds and checks the pairs and decodes masks,
:mod:`.dataset` holds the dataset, the joint transforms and the padding collate."""

from trainer.data.formats.segmentation.dataset import (
    EvalTransform,
    SegmentationCollate,
    SegmentationDataset,
    TrainTransform,
)
from trainer.data.formats.segmentation.pairs import PairingRule, SegSplit, decode_mask, parse_palette, scan_pairs

__all__ = [
    "EvalTransform",
    "PairingRule",
    "SegSplit",
    "SegmentationCollate",
    "SegmentationDataset",
    "TrainTransform",
    "decode_mask",
    "parse_palette",
    "scan_pairs",
]
