// File-system helpers with crash-safe semantics: the one file-system API of dflash's libraries.
//
// The rule, written once: library code (core, comm, attention, trainer) touches the file system
// only through these functions, never through std::filesystem. The PyPI LibTorch wheel's
// libtorch.so exports its own copy of std::filesystem's symbols, and calls that bind to that
// copy can crash (std::filesystem::remove_all does); POSIX calls have no such ambiguity.
//
// Owns nothing; every function is a plain POSIX sequence. write_file_atomic writes to
// `path.tmp`, fsyncs, renames over `path` and fsyncs the directory, so a reader sees either the
// old or the new content, never a half-written file. remove_tree deletes a directory tree with
// nftw.
// Thread-safety: stateless.
#pragma once

#include <string>
#include <vector>

namespace dflash::files {

void write_file_atomic(const std::string& path, const std::string& content);
std::string read_file(const std::string& path);  // UserError naming the file if unreadable
// Renames `from` to `to` (same file system) and fsyncs the parent directory of `to`.
void rename_durable(const std::string& from, const std::string& to);
void fsync_dir(const std::string& dir);
// Removes `path` and everything below it; a missing path is not an error.
void remove_tree(const std::string& path);
// mkdir -p; UserError naming the directory on failure.
void make_dirs(const std::string& path);
bool exists(const std::string& path);
bool is_dir(const std::string& path);
// "a" + "/" + "b" (no doubled slash; an absolute `b` is returned as it is).
std::string join(const std::string& a, const std::string& b);
// The directory part of `path` ("." for a bare name, "/" for a name under the root).
std::string parent(const std::string& path);
// The last component of `path` ("a/b.txt" -> "b.txt").
std::string basename(const std::string& path);
// Entry names of a directory (no "." / ".."), sorted; empty if it cannot be read.
std::vector<std::string> list_dir(const std::string& dir);

}  // namespace dflash::files
