"""The AWS side of Trainstack. Never imports torch.

``catalog.py`` (instance facts and prices, the one copy), ``config.py`` (typed CDK context), ``app.py`` and
``stacks/{data,monitoring,training}.py`` (CDK), ``constructs/`` (spot launch template, user data, SageMaker
spot jobs, CloudWatch agent, cdk-nag acknowledgements), ``cli/`` (``python -m infra``: push-image, launch,
submit, status, logs, stop, teardown, cost).
"""
