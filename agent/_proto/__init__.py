"""Code generated from proto/ by `make proto` (scripts/gen_proto.py). Never edited by hand."""
