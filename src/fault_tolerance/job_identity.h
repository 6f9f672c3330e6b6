// What makes a live job this job (LiveReplicas::declare_identity): items a rank and every
// replacement must declare alike, kept in the coordinator's store under "identity" (the first
// declaration is the job's, set atomically). A rank compares its own with the job's and refuses
// itself, naming the item, before it asks to join.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace fsdp::detail {

// The items as the store holds them (a JSON object, keys sorted).
std::string encode_identity(const std::map<std::string, std::string>& items);

// Why `mine` is not the job's identity `theirs` (both as encode_identity wrote them), naming the
// first item that differs and both values; nullopt when they are the same. A value that is not an
// identity (damaged, or from another version) says so.
std::optional<std::string> identity_difference(const std::string& mine, const std::string& theirs);

// A stable 64-bit digest of `text` (FNV-1a), in hex: for items too long to print (a model's
// parameter names, shapes and dtypes).
std::string digest(const std::string& text);

}  // namespace fsdp::detail
