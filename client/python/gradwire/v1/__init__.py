"""The protocol stubs, generated from ``proto/gradwire/v1`` by protoc and committed (the package
needs no build step). ``tests/python_stubs_check.sh`` regenerates them and fails when they differ
from what is committed here."""
