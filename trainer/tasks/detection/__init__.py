"""Object detection: DINO-4scale on COCO-format data, COCO box mAP."""

from trainer.tasks.detection.task import DetectionTask

__all__ = ["DetectionTask"]
