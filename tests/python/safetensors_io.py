"""The tests' safetensors reader and writer: the package's (moerun.safetensors_io), under the name
the tests have always imported."""

from moerun.safetensors_io import read_metadata, read_tensors, write_tensors  # noqa: F401
