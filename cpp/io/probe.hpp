// Which backends work on this machine, decided by a real transfer at run time.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace infinity::io {

/// Backend name -> "" if it works here, else why not (system call and errno).
const std::map<std::string, std::string>& probe_results();

/// Working backends, best first.
std::vector<std::string> available_backends();

}  // namespace infinity::io
