#pragma once
// One part of the program that links both flavours: the same source,
// compiled once per flavour (part.cpp), exposing a function of its own.
#include <string>

/// Writes and reads back a few tokens through a cache of this part's
/// flavour, on its own io_context; returns what went wrong, empty if
/// nothing did. Also names the flavour it ran in.
std::string run_standalone_part(std::string& flavour);
std::string run_boost_part(std::string& flavour);
