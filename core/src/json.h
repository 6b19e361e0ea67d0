// The JSON reader is part of the SDK (mt/json.h); the core's files include it by this name.
#pragma once

#include "mt/json.h"
