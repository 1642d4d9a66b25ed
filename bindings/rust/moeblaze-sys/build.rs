//! Finds libmoeblaze for linking.
//!
//! 1. `MOEBLAZE_LIB_DIR`: the directory holding libmoeblaze.so (e.g. a CMake build's `src/`).
//! 2. Otherwise the `pkg-config` *executable* (no crate needed), if it knows `moeblaze`.
//! 3. Otherwise the linker's default search path.
//!
//! With a directory, an rpath is added to this package's own test binaries (so `cargo test`
//! finds the library without LD_LIBRARY_PATH), and the directory is published to dependents as
//! `DEP_MOEBLAZE_LIB_DIR` (the `links` metadata), so their build scripts can do the same.
use std::env;
use std::process::Command;

fn pkg_config_libdir() -> Option<String> {
    let out = Command::new("pkg-config")
        .args(["--variable=libdir", "moeblaze"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = String::from_utf8(out.stdout).ok()?.trim().to_string();
    if dir.is_empty() {
        None
    } else {
        Some(dir)
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=MOEBLAZE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-changed=build.rs");

    let dir = env::var("MOEBLAZE_LIB_DIR")
        .ok()
        .filter(|d| !d.is_empty())
        .or_else(pkg_config_libdir);
    if let Some(dir) = dir {
        println!("cargo:rustc-link-search=native={dir}");
        // Applies to this package's tests, examples and binaries only, never to dependents.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        println!("cargo:lib_dir={dir}");
    }
    println!("cargo:rustc-link-lib=dylib=moeblaze");
}
