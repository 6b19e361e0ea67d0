// mt SDK version and plugin ABI version.
//
// MT_ABI_VERSION changes whenever a class or struct a plugin sees changes layout or a virtual
// function is added, removed or reordered. The loader refuses a plugin whose ABI differs.
#pragma once

#define MT_VERSION_MAJOR 0
#define MT_VERSION_MINOR 1
#define MT_VERSION_PATCH 0
#define MT_VERSION_STRING "0.1.0"
#define MT_ABI_VERSION \
  3u  // 2: Backend::sum_squares_each; 3: Backend::scatter_rows, GradNode::cast_of
