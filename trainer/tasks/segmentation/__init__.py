"""Semantic segmentation task (image/mask pairs, smp and torchvision models, mIoU)."""
