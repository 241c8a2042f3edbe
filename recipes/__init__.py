"""The recipes, shipped in the wheel as ``plugintrain.recipes`` (their YAML files as package
data) so that ``plugintrain fit --config <name>`` finds them without a checkout.

``plugintrain recipes`` lists them; :mod:`plugintrain.tools.recipes` reads them.
"""
