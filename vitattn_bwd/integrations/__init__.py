"""Integrations with model libraries. Each submodule imports its library lazily: importing
vitattn_bwd never requires them."""
