"""The AWS side of Trainstack (CDK stacks, instance catalog, boto3 CLI). Never imports torch.

Layout to come (see ../shared/DESIGN.md): ``catalog.py`` (instance facts and prices, the one copy),
``stacks/{data,training,monitoring}.py``, ``constructs/``, ``__main__.py`` (push-image, launch, submit,
status, logs, stop, teardown, cost). Nothing is implemented here yet.
"""
