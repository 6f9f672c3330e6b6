// A checkpoint's manifest.json (docs/checkpoints.md): what the checkpoint holds, where each piece
// of each tensor lives, every file with its size and CRC-32C, and a CRC-32C of the manifest itself.
//
// A manifest is input from disk, and disks, copies and people damage files: everything fsdp reads
// from it is checked here against a schema before anything else looks at it, so that a missing or
// mistyped field is an error that names the field (never nlohmann's operator[] on a const object,
// never 2.9 read as 2 or 2^64 - 1 as -1), and a file path cannot leave the checkpoint's folder.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace fsdp {

// Version 2 carries "manifest_crc32c"; version 1 (before it) is still read, without that check.
inline constexpr int kManifestVersion = 2;

// Adds the checksum field (over the canonical dump of everything else) and returns the text to
// write.
std::string manifest_text(nlohmann::json manifest);

// Reads, checksums and validates `folder`/manifest.json. Throws std::runtime_error naming the
// folder, the field (e.g. `pieces["h.0.weight"][1].flat[0]`) and what is wrong with it.
nlohmann::json read_manifest(const std::string& folder);

// The same checks on a manifest already parsed (the checkpoint fuzzer's mutations, the checksum
// recomputed, go through them too). `origin` names it in messages.
void validate_manifest(const nlohmann::json& manifest, const std::string& origin);

// The manifest's checksum as it is on disk (0 if it has none): ranks compare it to know they read
// the same manifest.
uint32_t manifest_checksum(const nlohmann::json& manifest);

}  // namespace fsdp
