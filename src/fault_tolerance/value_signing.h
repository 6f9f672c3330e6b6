// Authenticated values in the live replicas' store (docs/cluster.md, "Who can talk to the
// coordinator"): with a job secret (FSDP_LIVE_SECRET, or the first line of the file named by
// FSDP_LIVE_SECRET_FILE), every value a rank or the coordinator writes carries an HMAC-SHA256 of
// its key and value under the secret, and every value read is checked: a client that reaches the
// store's port but holds no secret can write keys, never a value anyone accepts. Without a secret,
// values are written and read as they are (a job on a trusted network, or one host's loopback).
#pragma once

#include <optional>
#include <string>

namespace fsdp::detail {

// FSDP_LIVE_SECRET, else the first line of FSDP_LIVE_SECRET_FILE, else empty. Throws
// std::invalid_argument when the file is named and cannot be read, or the secret is too short to
// be one (under 16 characters).
std::string live_secret_from_environment();

// The hex HMAC-SHA256 of `message` under `key` (RFC 2104 over FIPS 180-4).
std::string hmac_sha256_hex(const std::string& key, const std::string& message);

// `value` with its tag for `key` under `secret` ("value" itself when the secret is empty).
std::string sign_value(const std::string& secret, const std::string& key, const std::string& value);
// The value of a signed one when its tag is right for `key` under `secret`; nullopt otherwise
// (forged, damaged, or written by a process without the job's secret).
std::optional<std::string> verify_value(const std::string& secret, const std::string& key, const std::string& stored);

}  // namespace fsdp::detail
