"""CDK entry point: ``cdk deploy TrainingStack`` (see cdk.json).

The stacks (data, training, monitoring) are built in ``infra/`` by the CDK-stacks issue; until then this
app synthesizes no stack. It never imports torch.
"""

import aws_cdk as cdk

app = cdk.App()
app.synth()
