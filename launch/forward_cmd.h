// `moerun forward`: one MoE layer over the tensor `input` [T, H] of a safetensors file, written
// as `output` [T, H] to another. One process for now.
#pragma once

#include <CLI/CLI.hpp>

namespace moerun {

// Registers the subcommand; returns a function that runs it (exit code) once parsed.
std::function<int()> AddForwardCommand(CLI::App& app);

}  // namespace moerun
