# The usage requirements of each ghostlink flavour, written once. Both CMake
# ways of getting ghostlink apply them: the top-level CMakeLists.txt
# (add_subdirectory, FetchContent) to the libraries it builds, and the
# installed ghostlinkConfig.cmake (after `meson install`) to its imported
# targets. Meson's ghostlink.pc and ghostlink-boost.pc carry the same flags.
#
#   ghostlink_find_flavour(<flavour> <found-var>)
#     Finds what <flavour> (standalone or boost) needs: Threads, and
#     standalone Asio's headers or Boost >= 1.81's. Sets <found-var>, and
#     GHOSTLINK_<FLAVOUR>_NOT_FOUND to the reason when not found.
#   ghostlink_usage_requirements(<target> <INTERFACE|PUBLIC> <flavour>)
#     The C++20 requirement, the threads, the Asio headers and the defines:
#     GHOSTLINK_ASIO_BOOST=1 selects the Boost flavour; the Asio workarounds
#     depend on the consumer's compiler, so they are generator expressions.
include_guard(GLOBAL)

function(ghostlink_find_flavour flavour found_var)
  string(TOUPPER "${flavour}" up)
  set(reason "")
  find_package(Threads QUIET)
  if(NOT Threads_FOUND)
    set(reason "no threads library")
  elseif(flavour STREQUAL "boost")
    # Boost.Asio 1.26: Debian's libboost1.81-dev (1.74 lacks names ghostlink uses).
    find_package(Boost 1.81 QUIET CONFIG)
    if(NOT Boost_FOUND OR NOT TARGET Boost::headers)
      set(reason "Boost >= 1.81 not found (Debian: libboost1.81-dev; or set Boost_DIR)")
    endif()
  else()
    find_path(GHOSTLINK_ASIO_INCLUDE_DIR NAMES asio/version.hpp DOC "Standalone Asio's include directory")
    if(NOT GHOSTLINK_ASIO_INCLUDE_DIR)
      set(reason "standalone Asio (asio/version.hpp) not found (Debian: libasio-dev; or set GHOSTLINK_ASIO_INCLUDE_DIR)")
    endif()
  endif()
  if(reason STREQUAL "")
    set(${found_var} TRUE PARENT_SCOPE)
  else()
    set(${found_var} FALSE PARENT_SCOPE)
  endif()
  set(GHOSTLINK_${up}_NOT_FOUND "${reason}" PARENT_SCOPE)
endfunction()

function(ghostlink_usage_requirements target scope flavour)
  target_compile_features(${target} ${scope} cxx_std_20)
  target_link_libraries(${target} ${scope} Threads::Threads)
  # Clang < 17 may keep a thread_local's address across co_await (LLVM issue
  # 63022): Asio's per-thread cache of coroutine frames then hands one frame
  # to two threads. Allocate frames plainly there.
  set(clang_before_17 "$<AND:$<CXX_COMPILER_ID:Clang>,$<VERSION_LESS:$<CXX_COMPILER_VERSION>,17>>")
  if(flavour STREQUAL "boost")
    target_link_libraries(${target} ${scope} Boost::headers)
    target_compile_definitions(${target} ${scope} GHOSTLINK_ASIO_BOOST=1
      "$<${clang_before_17}:BOOST_ASIO_DISABLE_AWAITABLE_FRAME_RECYCLING=1>")
  else()
    target_include_directories(${target} SYSTEM ${scope} "${GHOSTLINK_ASIO_INCLUDE_DIR}")
    target_compile_definitions(${target} ${scope} "$<${clang_before_17}:ASIO_DISABLE_AWAITABLE_FRAME_RECYCLING=1>")
    # Asio < 1.23 does not detect C++20 coroutines under Clang with libstdc++.
    file(STRINGS "${GHOSTLINK_ASIO_INCLUDE_DIR}/asio/version.hpp" line REGEX "^#define ASIO_VERSION [0-9]+")
    string(REGEX REPLACE "^#define ASIO_VERSION ([0-9]+).*" "\\1" asio_version "${line}")
    if(asio_version LESS 102300)
      target_compile_definitions(${target} ${scope}
        "$<$<CXX_COMPILER_ID:Clang>:ASIO_HAS_CO_AWAIT=1>" "$<$<CXX_COMPILER_ID:Clang>:ASIO_HAS_STD_COROUTINE=1>")
    endif()
  endif()
endfunction()
