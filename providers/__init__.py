"""Where proxies run: the provider contract and one module per provider.

Nothing in this package imports temporalio; activities are the only bridge
between the workflows and these modules.
"""
