// Helpers shared by mover.cpp, which defines them, and raise.cpp; not part of the module's
// interface.
#pragma once

#include <string>

#include "mover.h"

namespace mgraph {

// A bad command or an unreachable rank, reported as a Failure of no particular command.
[[noreturn]] void fail(const std::string& message);

// "host", "cuda", "socket", "verbs" or "none", for messages.
const char* place_name(Place p);

}  // namespace mgraph
