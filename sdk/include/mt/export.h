// Symbol visibility for classes shared across the plugin boundary.
#pragma once

#include <boost/config.hpp>

// Interface classes: their typeinfo and vtables must be visible across shared objects, even
// though plugins are built with -fvisibility=hidden.
#define MT_API BOOST_SYMBOL_VISIBLE
