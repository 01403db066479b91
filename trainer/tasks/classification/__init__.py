"""Image classification (torchvision models, ImageFolder or FFCV data, top-1/top-5)."""

from trainer.tasks.classification.task import ClassificationTask, build_classifier, classification_models

__all__ = ["ClassificationTask", "build_classifier", "classification_models"]
