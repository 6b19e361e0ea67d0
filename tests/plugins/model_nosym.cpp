// A shared object named like a plugin but without the registration entry.
extern "C" int mt_not_a_plugin() { return 0; }
