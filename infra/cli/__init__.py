"""boto3 CLI operating a deployed environment: ``python -m infra --help`` (see infra/cli/main.py)."""
