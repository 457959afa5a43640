"""Generated from proto/dra/ by scripts/gen_proto.py. Never edited by hand."""
