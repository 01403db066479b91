"""Loop components: optimizer and LR schedule, precision policy, EMA."""
